"""Selection's confidence and greedy token per logits row: the largest softmax probability,
1 / sum(exp(x - max)), and the first column holding the max (torch.argmax's choice among ties).

`torch.softmax(x, dtype=float32).amax(-1)` writes a float32 copy of every row (1024 rows x the
100,352-wide padded vocabulary at 32 requests: 411 MB written and read back, about 0.8 ms per
pass on an H200), and the greedy tokens were a second pass over the selected rows (a float32
gather, then an argmax reduction: 23 us of a one-request pass). On CUDA Triton reads each row
once, with an online max and sum, and keeps each lane's first column of its max; elsewhere the
softmax expression and torch.argmax run (CPU: the parity tests' numerics, unchanged).

A one-request pass has at most 64 rows: one program per row left most SMs idle and took 30 us
(0.43 TB/s, H100 profile of 2026-12-07). So each row is split into column chunks, enough programs
to give every SM two, and a second kernel combines each row's chunks (max, rescaled sum, first
column of the max), as flash attention combines its KV splits.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU environments: the torch expressions below
    triton = None


# Rows per softmax on the CPU: a few rows' logits stay in cache from the softmax through its max and
# the argmax (400 rows of 100k: 173 -> 88 ms on one thread); each row's softmax is computed on its
# own, so the bits are those of one call over all the rows.
CPU_ROWS = 4
FIRST_MAX_CHUNK = 1024  # columns per chunk of `first_max`
BLOCK = 2048  # columns per iteration of a program's loop
MAX_SPLITS = 32  # chunks per row at most (a 100k row: ~3k columns each)
PROGRAMS_PER_SM = 2


def row_confidence(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, V] logits (-inf where banned) -> ([R] float32 max softmax probability, [R] int64
    argmax: the first column among equal maxima)."""
    if triton is None or x.device.type != "cuda" or x.shape[0] == 0:
        parts = x.split(CPU_ROWS) if x.device.type == "cpu" else (x,)
        conf, top = zip(*((torch.softmax(p, -1, dtype=torch.float32).amax(-1), first_max(p)[1]) for p in parts))
        return torch.cat(conf), torch.cat(top)
    return row_confidence_split(x.contiguous(), splits_for(x.shape[0], _sm_count(x.device)))


def first_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x.max(-1) of x [R, V]: each row's max and the first column holding it (a NaN's where the
    row has one), in a quarter of its time on the CPU, where max with indices runs scalar code and
    amax runs vectorized (4 x 100,281 floats: 340 -> 79 us on one core). amax finds the max of
    each FIRST_MAX_CHUNK-column chunk; max with indices then runs on each row's first chunk
    holding the row's max (its columns past the row's end read the last column again: later in
    the chunk, so never the first of equal maxima)."""
    width = x.shape[1]
    whole = width - width % FIRST_MAX_CHUNK
    heads = x[:, :whole].unflatten(-1, (-1, FIRST_MAX_CHUNK)).amax(-1)
    if whole < width:
        heads = torch.cat([heads, x[:, whole:].amax(-1, keepdim=True)], 1)
    best, chunk = heads.max(-1)
    cols = (chunk * FIRST_MAX_CHUNK)[:, None] + torch.arange(FIRST_MAX_CHUNK, device=x.device)
    return best, chunk * FIRST_MAX_CHUNK + x.gather(1, cols.clamp_(max=width - 1)).max(-1).indices


def splits_for(rows: int, sms: int) -> int:
    """Chunks per row: enough for PROGRAMS_PER_SM programs on every SM, at most MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, triton.cdiv(PROGRAMS_PER_SM * sms, rows)))


def row_confidence_split(x: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two kernels over x [R, V] contiguous, each row in about `splits` chunks of whole
    BLOCKs (fewer where the row has fewer blocks: no chunk is empty)."""
    rows, vocab = x.shape
    chunk = triton.cdiv(triton.cdiv(vocab, splits), BLOCK) * BLOCK
    splits = triton.cdiv(vocab, chunk)
    m = torch.empty(rows, splits, dtype=torch.float32, device=x.device)
    s, at = torch.empty_like(m), torch.empty(rows, splits, dtype=torch.int64, device=x.device)
    _chunk_kernel[(rows, splits)](x, m, s, at, vocab, chunk, splits, BLOCK=BLOCK, num_warps=8)
    conf = torch.empty(rows, dtype=torch.float32, device=x.device)
    top = torch.empty(rows, dtype=torch.int64, device=x.device)
    _combine_kernel[(rows,)](m, s, at, conf, top, vocab, splits, MAX_SPLITS=MAX_SPLITS, num_warps=1)
    return conf, top


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


if triton is not None:
    # Sizes are not specialized (a chunk or split count of 1 or a multiple of 16 would otherwise
    # compile a variant of its own, mid-serve, the first time a row count calls for it).

    @triton.jit
    def _merge(m, s, at, vocab):
        """Partial maxima m, their sums s = sum(exp(x - m)) and first columns `at` (a chunk's lanes,
        or a row's chunks) -> the max, the sum rescaled to it, and the first column holding it."""
        top = tl.max(m, axis=0)
        total = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - top), 0.0), axis=0)
        return top, total, tl.min(tl.where(m == top, at, vocab), axis=0)

    @triton.jit(do_not_specialize=["vocab", "chunk", "splits"])
    def _chunk_kernel(x_ptr, m_ptr, s_ptr, at_ptr, vocab, chunk, splits, BLOCK: tl.constexpr):
        """One chunk of one row: its max m, sum(exp(x - m)) and first column of m."""
        row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
        base = x_ptr + row * vocab
        lanes = tl.arange(0, BLOCK)
        start = part * chunk
        end = tl.minimum(start + chunk, vocab)
        m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
        s = tl.zeros((BLOCK,), dtype=tl.float32)
        # Each lane's first column of its max (a lane scans its columns in order; only a larger
        # value moves it). A lane that sees only -inf keeps its first column, so an all -inf
        # chunk gives its first column (and an all -inf row column 0, as torch.argmax does).
        at = start + lanes
        for offset in range(0, chunk, BLOCK):
            cols = start + offset + lanes
            x = tl.load(base + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
            at = tl.where(x > m, cols, at)
            m_new = tl.maximum(m, x)
            live = m_new > float("-inf")  # a lane that has seen only -inf keeps s = 0
            s = tl.where(live, s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
            m = m_new
        top, total, first = _merge(m, s, at, vocab)
        out = row * splits + part
        tl.store(m_ptr + out, top)
        tl.store(s_ptr + out, total)
        tl.store(at_ptr + out, first.to(tl.int64))

    @triton.jit(do_not_specialize=["vocab", "splits"])
    def _combine_kernel(m_ptr, s_ptr, at_ptr, conf_ptr, top_ptr, vocab, splits, MAX_SPLITS: tl.constexpr):
        """A row's chunks: 1 / the sum rescaled to the row's max, and the first column of it."""
        row = tl.program_id(0).to(tl.int64)
        parts = tl.arange(0, MAX_SPLITS)
        live = parts < splits
        m = tl.load(m_ptr + row * splits + parts, mask=live, other=float("-inf"))
        s = tl.load(s_ptr + row * splits + parts, mask=live, other=0.0)
        at = tl.load(at_ptr + row * splits + parts, mask=live, other=vocab)
        # an all -inf row has every chunk at -inf, and its first chunk's first column: 0
        _, total, first = _merge(m, s, at, vocab)
        tl.store(conf_ptr + row, 1.0 / total)
        tl.store(top_ptr + row, first)
