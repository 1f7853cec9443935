"""Attention's output on its way to the FP8 c_proj (worker/fp8.py's `Fp8Attention`): the heads
of each token joined and quantized per row by one op (`cde::heads_quantize`, its float32
definition here; the Triton kernel in tests/kernels/test_triton_interpreted.py and on the GPU), at
one request only, with the tokens of the plain path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cde.kernels import fp8_ops
from cde.shared.protocol import GenerateRequest
from cde.worker import fp8
from cde.worker.engine import Engine, EngineArgs
from cde.worker.model import Attention


def test_heads_quantize_op_joins_each_tokens_heads_and_quantizes_the_rows() -> None:
    """y [N, H, T, Dh] laid out as the attention kernel leaves it (heads outermost, not contiguous)
    against float64: row n * T + t is token t of item n, its heads one after another."""
    g = torch.Generator().manual_seed(12)
    y = (torch.randn(3, 2, 5, 8, generator=g) * 4).to(torch.bfloat16).transpose(0, 1)  # [N=2, H=3, T=5, Dh=8]
    y[1, :, 4] = 0.0  # token 4 of item 1: zeros and the minimum scale, no NaN
    assert not y.is_contiguous()
    q, scale = fp8_ops.heads_quantize(y)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (10, 24) and scale.shape == (10,)
    joined = torch.stack([torch.cat([y[n, h, t] for h in range(3)]) for n in range(2) for t in range(5)]).double()
    assert torch.allclose(scale.double(), (joined.abs().amax(-1) / 448.0).clamp(min=1e-12), rtol=1e-6)
    assert torch.equal(q[9].float(), torch.zeros(24))
    back = q.double() * scale.double()[:, None]
    assert ((back - joined).abs() <= joined.abs() * 2**-4 + scale.double()[:, None] * 2**-10 + 1e-9).all()


def test_fp8_attention_joins_and_quantizes_in_one_op_only_at_one_request(
    small_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At one item (64 rows: c_proj on the Triton GEMM) the op runs and gives what the plain
    projection gives (the join, then Fp8Linear quantizing its input); at two items the plain
    projection runs."""
    engine = Engine(EngineArgs(str(small_dir), quantization="fp8", max_running=2))
    attn = engine.runner.model.transformer.blocks[0].attn
    assert isinstance(attn, fp8.Fp8Attention)
    cfg = engine.cfg
    op, calls = fp8.heads_quantize, []
    monkeypatch.setattr(fp8, "heads_quantize", lambda y: calls.append(y.shape[0]) or op(y))
    torch.manual_seed(3)
    for items in (1, 2):
        y = torch.randn(cfg.n_head, items, 64, cfg.head_dim).to(torch.bfloat16).transpose(0, 1)
        assert torch.equal(attn.project(y), Attention.project(attn, y))
    assert calls == [1]


def test_fp8_attention_keeps_the_tokens_of_the_plain_projection(
    small_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request through the engine with Fp8Attention and with the plain Attention on the same
    FP8 layers: the same greedy tokens, and the op ran once per layer and pass."""

    def generate(joined_by_op: bool) -> tuple[list[int], int, int]:
        engine = Engine(EngineArgs(str(small_dir), quantization="fp8", max_running=1))
        blocks = engine.runner.model.transformer.blocks
        if not joined_by_op:
            for block in blocks:
                block.attn.__class__ = Attention
        calls: list[int] = []
        op = fp8.heads_quantize
        monkeypatch.setattr(fp8, "heads_quantize", lambda y: calls.append(1) or op(y))
        out = engine.generate([GenerateRequest("r", [5, 6, 7], max_tokens=24)])
        monkeypatch.undo()
        return out["r"], len(calls), engine.forward_passes * len(blocks)

    tokens, calls, layer_passes = generate(joined_by_op=True)
    plain, plain_calls, _ = generate(joined_by_op=False)
    assert tokens == plain and len(tokens) == 24
    assert calls == layer_passes > 0 and plain_calls == 0
