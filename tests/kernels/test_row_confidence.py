"""kernels/row_confidence.py on the CPU (the kernel itself: test_triton_interpreted.py, test_gpu.py):
the rows taken a few at a time give the bits of one softmax over them all, and argmax's choices;
`first_max` is torch's max with indices."""

import pytest
import torch
from cde.kernels.row_confidence import CPU_ROWS, FIRST_MAX_CHUNK, first_max, row_confidence


def test_cpu_rows_in_chunks_are_the_softmax_max_and_the_first_argmax():
    g = torch.Generator().manual_seed(5)
    rows = 3 * CPU_ROWS - 1  # a last chunk that is not full
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(rows, 3000, generator=g) * 4).to(dtype)
        x[:, 2900:] = float("-inf")  # banned columns
        x[1, [7, 900, 1500]] = 60.0  # tied maxima: the first column wins
        x[CPU_ROWS + 2] = float("-inf")  # all banned: NaN confidence, column 0, as torch says
        conf, top = row_confidence(x)
        want = torch.softmax(x, -1, dtype=torch.float32).amax(-1)
        assert torch.equal(conf.nan_to_num(-1.0), want.nan_to_num(-1.0)) and conf.dtype == torch.float32
        assert torch.equal(top, x.argmax(-1)) and top[1] == 7 and top[CPU_ROWS + 2] == 0
    conf, top = row_confidence(torch.empty(0, 3000))
    assert conf.shape == top.shape == (0,)


@pytest.mark.parametrize("width", [1, FIRST_MAX_CHUNK - 3, FIRST_MAX_CHUNK, 3 * FIRST_MAX_CHUNK, 100281])
def test_first_max_is_torchs_max_with_indices(width):
    """Ties within a chunk, across chunks and in the short last chunk, all-banned rows, NaN, no
    rows: each row's value and first column, as x.max(-1) gives them."""
    g = torch.Generator().manual_seed(width)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randint(0, 3, (9, width), generator=g).to(dtype)  # many tied maxima
        x[1] = torch.randn(width, generator=g).to(dtype)
        x[2] = float("-inf")
        x[3, -1] = 9.0  # the max in the last column only
        x[4, width // 2 :] = 7.0  # the first of a run of maxima that crosses chunks
        x[5, width // 3] = float("nan")
        x[5, -1] = float("nan")
        x[6, -1], x[6, 0] = 5.0, 5.0
        for rows in (x, x[:0]):
            want, got = rows.max(-1), first_max(rows)
            assert torch.equal(got[0].nan_to_num(-1.0), want.values.nan_to_num(-1.0))
            assert torch.equal(got[1], want.indices)
