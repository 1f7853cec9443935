"""Issue 29 experiment: the residual add, RMSNorm and the FP8 per-token quantization in one kernel.

On the H200 the fp8 engine's compiled blocks run each pre-norm as two looped reductions (profile,
2026-12-02: `..._add_mean_mul_pow_rsqrt` then `..._abs_add_amax_clamp_div_fp8_matmul`, ~3 us each
at one request, twice per layer): Inductor makes rows of more than 1,024 values looped reductions,
and a reduction that depends on another (the amax of the normed row) cannot share a looped kernel.
As persistent reductions (a 4,096-wide row held in registers) they can. This script compiles
`h = x + delta; q, s = quantize_rows(rms_norm(h)); out = fp8 c_attn(q)` with Inductor's default
choices and with persistent reductions for rows of up to 4,096, and prints for 64 and 2,048 rows
the kernels Inductor generated and the CUDA-graph-replayed time of 32 such layers (the same weights
read as a pass reads them), with the largest difference between the two outputs.
Run: PYTHONPATH=. python3 scripts/norm_quant_experiment.py [--cpu] (--cpu: a small shape on the CPU,
outputs only: the check CI runs).
"""

from __future__ import annotations

import sys

import torch
from cde.worker.cuda_timing import graph_replay_ms
from cde.worker.fp8 import Fp8Linear
from cde.worker.model import RMSNorm
from torch._inductor import metrics
from torch._inductor.choices import InductorChoices
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V

PERSISTENT_ROWS = 4096  # the 8b's n_embd


class PersistentRows(InductorChoices):
    """Inductor's choices, but a row reduction of up to PERSISTENT_ROWS values is persistent."""

    @staticmethod
    def should_use_persistent_reduction(features, cooperative_reduction):  # type: ignore[no-untyped-def]
        if features.get_reduction_hint() == ReductionHint.INNER and V.graph.sizevars.statically_known_leq(
            features.reduction_numel, PERSISTENT_ROWS
        ):
            return True
        return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)


def layer_fn(norm: RMSNorm, linear: Fp8Linear):  # type: ignore[no-untyped-def]
    def fn(x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + delta
        return h, linear(norm(h))

    return fn


@torch.no_grad()
def run(device: str, rows_list: tuple[int, ...], width: int, outputs: int, layers: int) -> int:
    torch.manual_seed(0)
    stack = []
    for _ in range(layers):
        lin = torch.nn.Linear(width, outputs, bias=False, device=device, dtype=torch.bfloat16)
        torch.nn.init.normal_(lin.weight, std=0.02)
        norm = RMSNorm(width, 1e-5).to(device)
        norm.weight.data.uniform_(0.5, 1.5)
        stack.append(layer_fn(norm, Fp8Linear.from_linear(lin)))
    print("| rows | choices | kernels per layer | ms (32 layers) | max abs diff vs eager |")
    print("| --- | --- | --- | --- | --- |")
    worst = 0.0
    for rows in rows_list:
        x = torch.randn(rows, width, device=device, dtype=torch.bfloat16)
        delta = torch.randn_like(x)
        eager = stack[0](x, delta)[1].float()
        for name, choices in (("default", InductorChoices()), ("persistent rows", PersistentRows())):
            # one code object, a compile per layer's weights: past the limit Dynamo would run them eagerly
            torch._dynamo.reset()
            V.set_choices_handler(choices)
            metrics.reset()
            compiled = [torch.compile(fn, dynamic=False) for fn in stack]
            with torch._dynamo.config.patch(recompile_limit=2 * layers, fail_on_recompile_limit_hit=True):
                out = compiled[0](x, delta)[1].float()
                kernels = metrics.generated_kernel_count  # the first layer's compile
                ms = "—"
                if device == "cuda":
                    ms = f"{graph_replay_ms(lambda fs=compiled, a=x, d=delta: [f(a, d) for f in fs])[0]:.3f}"
            diff = (out - eager).abs().max().item()
            worst = max(worst, diff / eager.abs().max().item())
            print(f"| {rows} | {name} | {kernels} | {ms} | {diff:.2e} |")
    V.set_choices_handler(InductorChoices())
    return 0 if worst < 0.05 else 1  # e4m3 rounding of the rows either way, nothing more


if __name__ == "__main__":
    if "--cpu" in sys.argv:
        sys.exit(run("cpu", (5,), 256, 96, 1))
    sys.exit(run("cuda", (64, 2048), 4096, 5120, 32))
