"""Issue 29 experiment: the MLP's up projection with `silu(gate) * up` fused into the GEMM's epilogue.

Today c_fc is one cuBLAS GEMM writing [rows, 2F] in bfloat16 and a compiled pointwise kernel reads
it back to write `silu(gate) * up` [rows, F]: at 32 requests (2,048 rows) on the 8b that is ~235 MB
per layer of traffic beyond the GEMM's own. This Triton kernel computes a tile of `up` and the
matching tile of `gate` in one CTA and writes only their product. Before the engine uses it, this
script times, over the 32 layers' own weights (as a pass reads them): cuBLAS + the compiled
pointwise, and the fused kernel, at 2,048 and 64 rows, and checks the fused kernel against the
two-step result (bfloat16 rounding). Run: PYTHONPATH=. python3 scripts/swiglu_gemm_experiment.py
[--interpret] (--interpret: a small float16 shape in Triton's interpreter, for the CPU).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
import triton
import triton.language as tl
from cde.kernels.stream_ops import swiglu


def _configs() -> list:
    wide = [(128, bn, 64, st, 8) for bn in (64, 128) for st in (3, 4)]
    few_rows = [(64, bn, bk, st, 4) for bn in (64, 128) for bk in (64, 128) for st in (4, 6) if bn * bk * st <= 65536]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=st, num_warps=w)
        for bm, bn, bk, st, w in wide + few_rows
    ]


@triton.jit
def _swiglu_kernel(x_ptr, w_ptr, out_ptr, M, F, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), F // BLOCK_N
    # Grouped order: GROUP_M row tiles share each weight tile while it is in L2.
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x = x_ptr + rm[:, None] * K + rk[None, :]
    w_up = w_ptr + rn[None, :] * K + rk[:, None]  # rows [0, F) of c_fc's weight: up
    w_gate = w_up + F * K  # rows [F, 2F): gate
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(x, mask=rm[:, None] < M, other=0.0)
        acc_up = tl.dot(a, tl.load(w_up), acc_up)
        acc_gate = tl.dot(a, tl.load(w_gate), acc_gate)
        x += BLOCK_K
        w_up += BLOCK_K
        w_gate += BLOCK_K
    # The two-step path rounds up and gate to the GEMM's dtype before the pointwise kernel.
    dtype = out_ptr.dtype.element_ty
    up = acc_up.to(dtype).to(tl.float32)
    gate = acc_gate.to(dtype).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rm[:, None] * F + rn[None, :], out.to(dtype), mask=rm[:, None] < M)


_swiglu_tuned = triton.autotune(configs=_configs(), key=["M", "F", "K"])(_swiglu_kernel)


def swiglu_linear(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """silu(gate) * up of c_fc: x [M, K], weight [2F, K] (up rows, then gate rows) -> [M, F].
    `config`: one kernel config instead of autotuning (the interpreter cannot time)."""
    m, k = x.shape
    f = weight.shape[0] // 2
    assert f % 128 == 0 and k % 128 == 0 and x.is_contiguous() and weight.is_contiguous()
    out = torch.empty(m, f, dtype=x.dtype, device=x.device)

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * (f // meta["BLOCK_N"]),)

    if config is None:
        _swiglu_tuned[grid](x, weight, out, m, f, k)
    else:
        _swiglu_kernel[grid](x, weight, out, m, f, k, **config)
    return out


def two_step(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return swiglu(F.linear(x, weight))  # the engine's two steps (worker/model.py's MLP)


def check(m: int, k: int, f: int, dtype: torch.dtype, device: str) -> float:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    w = (torch.randn(2 * f, k, generator=g, device=device) / k**0.5).to(dtype)
    config = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 2}
    ref, got = two_step(x.float(), w.float()), swiglu_linear(x, w, config).float()
    return ((got - ref).abs().max() / ref.abs().max()).item()


def main() -> None:
    if "--interpret" in sys.argv:  # Triton's interpreter decodes bfloat16 loads wrongly: float16
        err = check(100, 256, 256, torch.float16, "cpu")  # a partial row tile, 4 column tiles, 4 K steps
        print(f"interpreter, 100 x 256 -> 256, float16: max relative error {err:.1e}")
        sys.exit(0 if err < 1e-2 else 1)
    from cde.shared.config import preset
    from cde.worker.cuda_timing import graph_replay_ms

    cfg = preset("8b")
    k, f, layers = cfg.n_embd, cfg.ffn_size, cfg.n_layers
    weights = [torch.randn(2 * f, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(layers)]
    pointwise = torch.compile(swiglu)
    print(f"| rows | cuBLAS + compiled silu*up, ms ({layers} layers) | fused Triton, ms | fused / cuBLAS | rel. err |")
    print("| --- | --- | --- | --- | --- |")
    for m in (2048, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        base, ref = graph_replay_ms(lambda x=x: [pointwise(F.linear(x, w)) for w in weights][-1])
        fused, got = graph_replay_ms(lambda x=x: [swiglu_linear(x, w) for w in weights][-1])
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        best = _swiglu_tuned.best_config
        print(f"| {m} | {base:.3f} | {fused:.3f} ({best}) | {fused / base:.2f}x | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
