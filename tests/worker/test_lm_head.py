"""The CPU LM head in vocabulary slices is the one GEMM's result, bit for bit."""

import pytest
import torch
import torch.nn.functional as F
from cde.shared.config import preset
from cde.worker.lm_head import VOCAB_SLICE, lm_head_logits


@pytest.mark.parametrize("name", ["tiny", "small"])
@pytest.mark.parametrize("rows", [1, 5, 64, 130])
def test_sliced_logits_are_the_whole_products_bits(name, rows):
    """At the presets' widths and the padded and unpadded vocabularies (the last slice short or
    whole), in float32 and bfloat16, with one and two threads, for the row counts of one item, a
    few and a padded batch."""
    cfg = preset(name)
    g = torch.Generator().manual_seed(rows)
    for vocab, dtype in (
        (cfg.vocab_size, torch.float32),
        (VOCAB_SLICE * 3, torch.float32),
        (cfg.vocab_size, torch.bfloat16),
    ):
        weight = torch.randn(vocab, cfg.n_embd, generator=g).to(dtype)
        hidden = torch.randn(rows, cfg.n_embd, generator=g).to(dtype)
        threads = torch.get_num_threads()
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                assert torch.equal(lm_head_logits(hidden, weight), F.linear(hidden, weight))
        finally:
            torch.set_num_threads(threads)
