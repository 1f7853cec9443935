"""Issue 16's kernel table on the GPU: the Triton kernels of kernels/fp8_triton.py and
kernels/row_confidence.py against what the engine ran before, each checked for agreement first.

1. The transformer's 32-layer linear stack of the 8b (distinct weights per layer, so nothing stays
   in L2) at 64/128/256/2048 rows, CUDA-graph timed: bfloat16 F.linear, torch._scaled_mm with
   per-row activation scales, and the Triton FP8 GEMM (autotuned per shape).
2. The MLP's activation quantization, [rows, 32768] -> e4m3 [rows, 16384] + scales: compiled
   `quantize_rows(silu(gate) * up)` against the Triton kernel.
3. Selection's confidence over [rows, 100352] bfloat16 logits: softmax + amax against the kernel.

    python scripts/bench_fp8_kernels.py [--layers 32]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from cde.kernels.fp8_triton import fp8_gemm, silu_mul_quantize
from cde.kernels.row_confidence import row_confidence
from cde.worker.fp8 import quantize_rows

SHAPES = [(5120, 4096), (4096, 4096), (32768, 4096), (4096, 16384)]  # c_attn, attn c_proj, c_fc, mlp c_proj


def graph_ms(fn, reps: int = 20) -> float:
    """Mean ms of fn() replayed from a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def stack(args: argparse.Namespace) -> None:
    dev = "cuda"
    torch.manual_seed(0)
    w16 = [[torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for n, k in SHAPES] for _ in range(args.layers)]
    wq = [[quantize_rows(w) for w in layer] for layer in w16]
    wq = [[(q, s[:, 0].contiguous()) for q, s in layer] for layer in wq]
    print("| rows | bf16 F.linear ms | _scaled_mm ms | Triton fp8 ms | Triton vs _scaled_mm | max rel diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in (64, 128, 256, 2048):
        xs = {k: torch.randn(rows, k, device=dev, dtype=torch.bfloat16) for _, k in SHAPES}
        xq = {k: quantize_rows(x) for k, x in xs.items()}
        xq = {k: (q, s[:, 0].contiguous(), s) for k, (q, s) in xq.items()}
        worst = 0.0
        for (_, k), (q, s) in zip(SHAPES, wq[0]):
            a, sa, sa2 = xq[k]
            ref = torch._scaled_mm(a, q.t(), scale_a=sa2, scale_b=s[None, :], out_dtype=torch.bfloat16).float()
            got = fp8_gemm(a, sa, q, s, torch.bfloat16).float()
            worst = max(worst, ((got - ref).norm() / ref.norm()).item())

        def bf16(xs: dict = xs) -> None:
            for layer in w16:
                for w in layer:
                    F.linear(xs[w.shape[1]], w)

        def scaled(xq: dict = xq) -> None:
            for layer in wq:
                for q, s in layer:
                    a, _, sa2 = xq[q.shape[1]]
                    torch._scaled_mm(a, q.t(), scale_a=sa2, scale_b=s[None, :], out_dtype=torch.bfloat16)

        def tri(xq: dict = xq) -> None:
            for layer in wq:
                for q, s in layer:
                    a, sa, _ = xq[q.shape[1]]
                    fp8_gemm(a, sa, q, s, torch.bfloat16)

        t16, tsc, ttr = graph_ms(bf16), graph_ms(scaled), graph_ms(tri)
        print(f"| {rows} | {t16:.3f} | {tsc:.3f} | {ttr:.3f} | {tsc / ttr:.2f}x | {worst:.1e} |", flush=True)


def act_quant() -> None:
    dev = "cuda"

    def compiled_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        up, gate = x.chunk(2, dim=-1)
        return quantize_rows(F.silu(gate) * up)

    ref_fn = torch.compile(compiled_quant, dynamic=False)
    print("\n| rows | compiled quantize_rows(silu*up) us | Triton us | speed-up | scales max rel diff | q mismatches |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in (64, 2048):
        x = torch.randn(rows, 32768, device=dev, dtype=torch.bfloat16)
        rq, rs = ref_fn(x)
        q, s = silu_mul_quantize(x)
        sdiff = ((s - rs[:, 0]).abs() / rs[:, 0]).max().item()
        mism = (q.float() != rq.float()).float().mean().item()
        tr, tt = graph_ms(lambda x=x: ref_fn(x), 50), graph_ms(lambda x=x: silu_mul_quantize(x), 50)
        print(f"| {rows} | {tr * 1e3:.1f} | {tt * 1e3:.1f} | {tr / tt:.2f}x | {sdiff:.1e} | {mism:.1e} |", flush=True)


def confidence() -> None:
    dev = "cuda"
    print("\n| rows | softmax + amax us | Triton us | speed-up | max rel diff |")
    print("| --- | --- | --- | --- | --- |")
    for rows in (64, 1024, 2048):
        x = (torch.randn(rows, 100352, device=dev) * 3).to(torch.bfloat16)
        x[:, 100281:] = float("-inf")
        x[:, 100257] = float("-inf")
        ref = torch.softmax(x, -1, dtype=torch.float32).amax(-1)
        got = row_confidence(x)
        diff = ((got - ref).abs() / ref).max().item()
        tr = graph_ms(lambda x=x: torch.softmax(x, -1, dtype=torch.float32).amax(-1), 50)
        tt = graph_ms(lambda x=x: row_confidence(x), 50)
        print(f"| {rows} | {tr * 1e3:.1f} | {tt * 1e3:.1f} | {tr / tt:.2f}x | {diff:.1e} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=32)
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    confidence()
    act_quant()
    stack(args)  # last: it holds 23 GB of weights


if __name__ == "__main__":
    main()
