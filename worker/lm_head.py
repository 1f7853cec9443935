"""The LM head's logits, hidden [R, D] x weight [V, D]^T, as one product on CUDA and in
vocabulary slices on the CPU.

On the CPU the whole product streams its output through memory: 64 rows of the 100,281-wide
vocabulary are 26 MB of float32, written once and never reused while the GEMM runs. Taken in
slices of VOCAB_SLICE weight rows, each slice's weights and its [R, VOCAB_SLICE] block of the
output stay in the core's cache (1 MB each at D = 64). On one core 64 rows took 26.8 -> 15.3 ms
at D = 64 and 88 -> 54 ms at D = 256 (the tiny and small presets, 2026-12-07); with four threads
15.7 -> 10.7 and 50.3 -> 41.4 ms. The LM head is most of a CPU pass (14 of the 21 s a tiny
model's parity test spent generating), so every CPU engine gains: CPU serving and the test suite.

Each logit is the same dot product over D either way (the slices split the vocabulary, never D),
so the bits are one GEMM's: tests/worker/test_lm_head.py asserts equality at the presets' shapes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB_SLICE = 2048  # weight rows per slice: the fastest of 2k-16k at D = 64 and 256, 1-4 threads


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[R, V] logits of hidden [R, D] under weight [V, D]."""
    if hidden.device.type != "cpu":
        return F.linear(hidden, weight)
    out = hidden.new_empty(hidden.shape[0], weight.shape[0])
    for start in range(0, weight.shape[0], VOCAB_SLICE):
        torch.mm(hidden, weight[start : start + VOCAB_SLICE].t(), out=out[:, start : start + VOCAB_SLICE])
    return out
