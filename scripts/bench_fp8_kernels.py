"""Issue 16's kernel table on the GPU: the Triton kernels of kernels/fp8_triton.py and
kernels/row_confidence.py against what the engine ran before, each checked for agreement first.

1. The transformer's 32-layer linear stack of the 8b (distinct weights per layer, so nothing stays
   in L2) at 64 to 2048 rows, CUDA-graph timed, beside its weight-read limit: bfloat16 F.linear
   and torch._scaled_mm with per-row activation scales (cuBLAS), accumulating as the tensor cores
   do by default (promoted to float32 every few K steps) and with fast accumulation (vLLM's and
   torchao's choice for inference), with the fast one's difference to the default; and at 64 rows
   the split-K Triton GEMM of kernels/stream_gemm.py in both (autotuned per shape; the configs it
   chose are printed).
2. The activation quantizations: the MLP's, [rows, 32768] -> e4m3 [rows, 16384] + scales, compiled
   `quantize_rows(silu(gate) * up)` against the Triton kernel; a post-norm block's residual after
   attention, compiled `quantize_rows(x + rms_norm(delta))` against the Triton kernel that also
   writes the residual.
3. The FP8 stack at one request chained as the engine runs it, each GEMM's input written by the
   fused residual kernel just before it: the GEMM launched plainly, then with programmatic
   dependent launch and its first 1-8 weight tiles prefetched to L2 while that kernel runs.
4. Selection's confidence and greedy token over [rows, 100352] bfloat16 logits: softmax + amax and
   argmax against the kernel.
5. Per weight shape at one request (64 rows): that shape's 32 layers back to back, bfloat16 on
   cuBLAS and on the split-K GEMM, FP8 on the split-K GEMM, each beside the shape's weight-read
   limit: which GEMMs of a one-request pass stream near the bandwidth and which pay their start.
6. Attention's c_proj at one request, 32 layers: the attention output's heads joined per token and
   quantized by the compiled definition (Inductor's kernel, which signals nothing) or by
   `heads_quantize` (which signals), each followed by the FP8 GEMM launched early with its weight
   prefetch, as the engine launches it; the quantizers alone beside them.

    python scripts/bench_fp8_kernels.py [--layers 32] [--only SECTION...]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from cde.kernels.fp8_ops import PREFETCH_TILES
from cde.kernels.fp8_triton import add_norm_quantize, heads_quantize, silu_mul_quantize
from cde.kernels.row_confidence import row_confidence, row_confidence_split, splits_for
from cde.kernels.stream_gemm import MAX_ROWS, counter_count, stream_gemm, tuned_configs, tuned_launch_configs
from cde.kernels.stream_ops import rms_norm, swiglu
from cde.worker.cuda_timing import graph_replay_ms
from cde.worker.fp8 import quantize_rows

from cde.commands.bench_roofline import this_card_bandwidth

SHAPES = [(5120, 4096), (4096, 4096), (32768, 4096), (4096, 16384)]  # c_attn, attn c_proj, c_fc, mlp c_proj


def scaled_mm(a: torch.Tensor, sa: torch.Tensor, q: torch.Tensor, s: torch.Tensor, fast: bool) -> torch.Tensor:
    """cuBLAS's FP8 GEMM with row scales sa [M, 1] and channel scales s [N], bfloat16 out."""
    return torch._scaled_mm(a, q.t(), scale_a=sa, scale_b=s[None, :], out_dtype=torch.bfloat16, use_fast_accum=fast)


def rel_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def graph_ms(fn, reps: int = 20) -> float:
    """Mean ms of fn() replayed from a CUDA graph."""
    return graph_replay_ms(fn, reps)[0]


def stack(args: argparse.Namespace) -> None:
    dev = "cuda"
    torch.manual_seed(0)
    w16 = [[torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for n, k in SHAPES] for _ in range(args.layers)]
    wq = [[quantize_rows(w) for w in layer] for layer in w16]
    wq = [[(q, s[:, 0].contiguous()) for q, s in layer] for layer in wq]
    counters = {n: torch.zeros(counter_count(n), dtype=torch.int32, device=dev) for n, _ in SHAPES}
    weights = args.layers * sum(n * k for n, k in SHAPES)
    bandwidth = this_card_bandwidth()
    limit16, limit8 = (weights * b / (bandwidth * 1e12) * 1e3 for b in (2, 1))
    print(f"weight-read limit of the stack at {bandwidth} TB/s: bf16 {limit16:.3f} ms, fp8 {limit8:.3f} ms")
    print(
        "| rows | bf16 F.linear ms | bf16 stream_gemm ms | fp8 _scaled_mm ms | fp8 _scaled_mm fast-accum ms "
        "| fp8 stream_gemm ms | max rel diff bf16 / fp8 / fast-accum |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rows in (64, 128, 256, 512, 2048):
        xs = {k: torch.randn(rows, k, device=dev, dtype=torch.bfloat16) for _, k in SHAPES}
        xq = {k: quantize_rows(x) for k, x in xs.items()}
        xq = {k: (q, s[:, 0].contiguous(), s) for k, (q, s) in xq.items()}
        streams = rows <= MAX_ROWS
        worst16 = worst8 = 0.0
        worst_fast = 0.0  # fast accumulation against the default, over the four shapes
        for (_, k), (q, s) in zip(SHAPES, wq[0]):
            a, _, sa2 = xq[k]
            worst_fast = max(worst_fast, rel_diff(scaled_mm(a, sa2, q, s, True), scaled_mm(a, sa2, q, s, False)))
        for (_, k), w, (q, s) in zip(SHAPES, w16[0], wq[0]) if streams else ():
            a, sa, sa2 = xq[k]
            ref8 = scaled_mm(a, sa2, q, s, False)
            got8 = stream_gemm(a, q, counters[q.shape[0]], torch.bfloat16, scales=(sa, s))
            worst8 = max(worst8, rel_diff(got8, ref8))
            ref16 = F.linear(xs[k], w)
            got16 = stream_gemm(xs[k], w, counters[w.shape[0]], torch.bfloat16)
            worst16 = max(worst16, rel_diff(got16, ref16))

        def bf16(xs: dict = xs) -> None:
            for layer in w16:
                for w in layer:
                    F.linear(xs[w.shape[1]], w)

        def bf16_stream(xs: dict = xs) -> None:
            for layer in w16:
                for w in layer:
                    stream_gemm(xs[w.shape[1]], w, counters[w.shape[0]], torch.bfloat16)

        def scaled(xq: dict = xq, fast: bool = False) -> None:
            for layer in wq:
                for q, s in layer:
                    a, _, sa2 = xq[q.shape[1]]
                    scaled_mm(a, sa2, q, s, fast)

        def fp8_stream(xq: dict = xq) -> None:
            for layer in wq:
                for q, s in layer:
                    a, sa, _ = xq[q.shape[1]]
                    stream_gemm(a, q, counters[q.shape[0]], torch.bfloat16, scales=(sa, s))

        t16, tsc, tfast = graph_ms(bf16), graph_ms(scaled), graph_ms(lambda: scaled(fast=True))
        s16, s8 = (f"{graph_ms(fn):.3f}" if streams else "—" for fn in (bf16_stream, fp8_stream))
        print(
            f"| {rows} | {t16:.3f} | {s16} | {tsc:.3f} | {tfast:.3f} | {s8} "
            f"| {worst16:.1e} / {worst8:.1e} / {worst_fast:.1e} |",
            flush=True,
        )
    print("autotuned stream_gemm configs (M, N, K, scaled): " + "; ".join(f"{k}: {v}" for k, v in tuned_configs()))


def pdl_chain(args: argparse.Namespace) -> None:
    dev = "cuda"
    torch.manual_seed(0)
    wq = [
        [quantize_rows(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02) for n, k in SHAPES]
        for _ in range(args.layers)
    ]
    wq = [[(q, s[:, 0].contiguous()) for q, s in layer] for layer in wq]
    counters = {n: torch.zeros(counter_count(n), dtype=torch.int32, device=dev) for n, _ in SHAPES}
    ins = {
        k: (
            *(torch.randn(MAX_ROWS, k, device=dev, dtype=torch.bfloat16) for _ in "xd"),
            torch.rand(k, device=dev) + 0.5,
        )
        for _, k in SHAPES
    }

    configs: dict[int, dict] = {}  # the plain launch's autotuned config per weight: every row runs the same

    def chain(prefetch: int | None) -> list[torch.Tensor]:  # None: the residual kernels alone
        outs = []
        for layer in wq:
            for q, s in layer:
                x, d, w = ins[q.shape[1]]
                _, xq, xs = add_norm_quantize(x, d, w.to(x.dtype), 1e-5)
                if prefetch is not None:
                    config = configs.get(q.shape[0]) if prefetch else None
                    out = stream_gemm(xq, q, counters[q.shape[0]], torch.bfloat16, (xs, s), config, prefetch=prefetch)
                    outs.append(out)
        return outs

    alone = graph_ms(lambda: chain(None))
    ref = chain(0)
    for key, config in tuned_launch_configs().items():
        if key[0] in {n for n, _ in SHAPES} and key[2] and key[5] == 0:  # N; SCALE_A; PREFETCH 0
            configs[key[0]] = config
    print(
        f"\n{args.layers} layers x 4 (residual kernel, FP8 GEMM) at {MAX_ROWS} rows; "
        f"the residual kernels alone {alone:.3f} ms"
    )
    print("| prefetched tiles (0: plain launch) | ms | ms less the residual kernels | max rel diff to plain |")
    print("| --- | --- | --- | --- |")
    for prefetch in (0, 1, 2, 4, 8):
        diff = max(rel_diff(g, r) for g, r in zip(chain(prefetch), ref))
        ms = graph_ms(lambda p=prefetch: chain(p))
        print(f"| {prefetch} | {ms:.3f} | {ms - alone:.3f} | {diff:.1e} |", flush=True)
    print("autotuned stream_gemm configs: " + "; ".join(f"{k}: {v}" for k, v in tuned_configs()))


def act_quant(args: argparse.Namespace) -> None:
    """The FP8 path's two fused activation quantizers against their compiled definitions."""
    dev = "cuda"

    def silu_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_rows(swiglu(x))

    def residual_ref(x: torch.Tensor, d: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_rows(x + rms_norm(d, w, 1e-5))

    def silu_inputs(rows: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(rows, 32768, device=dev, dtype=torch.bfloat16),)

    def residual_inputs(rows: int) -> tuple[torch.Tensor, ...]:
        x, d = (torch.randn(rows, 4096, device=dev, dtype=torch.bfloat16) for _ in "xd")
        return x, d, torch.rand(4096, device=dev, dtype=torch.bfloat16) + 0.5

    cases = (
        ("quantize_rows(silu*up)", silu_ref, silu_mul_quantize, silu_inputs),
        (
            "quantize_rows(x + rms_norm(d))",
            residual_ref,
            lambda x, d, w: add_norm_quantize(x, d, w, 1e-5)[1:],
            residual_inputs,
        ),
    )
    print("\n| op | rows | compiled us | Triton us | speed-up | scales max rel diff | q mismatches |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, ref, op, inputs in cases:
        ref_fn = torch.compile(ref, dynamic=False)
        for rows in (64, 2048):
            args = inputs(rows)
            rq, rs = ref_fn(*args)
            q, s = op(*args)
            sdiff = ((s - rs[:, 0]).abs() / rs[:, 0]).max().item()
            mism = (q.float() != rq.float()).float().mean().item()
            tr = graph_ms(lambda a=args, f=ref_fn: f(*a), 50)
            tt = graph_ms(lambda a=args, f=op: f(*a), 50)
            print(
                f"| {name} | {rows} | {tr * 1e3:.1f} | {tt * 1e3:.1f} | {tr / tt:.2f}x | {sdiff:.1e} | {mism:.1e} |",
                flush=True,
            )


def per_shape(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    limit_at = f"the limit at {this_card_bandwidth()} TB/s"
    print(f"\n{args.layers} layers of one shape at {MAX_ROWS} rows, ms (% of {limit_at})")
    print("| shape [N, K] | bf16 limit | bf16 cuBLAS | bf16 stream_gemm | fp8 limit | fp8 stream_gemm |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n, k in SHAPES:
        print(shape_row(n, k, args.layers), flush=True)


def shape_row(n: int, k: int, layers: int) -> str:
    """One row of `per_shape`: the shape's own weights per layer (from HBM, as a pass reads them)."""
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    wq = [(q, sc[:, 0].contiguous()) for q, sc in (quantize_rows(w) for w in w16)]
    x = torch.randn(MAX_ROWS, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_rows(x)
    xs = xs[:, 0].contiguous()
    counters = torch.zeros(counter_count(n), dtype=torch.int32, device="cuda")
    limit16, limit8 = (layers * n * k * b / (this_card_bandwidth() * 1e12) * 1e3 for b in (2, 1))

    def cell(limit: float, fn) -> str:
        ms = graph_ms(fn)
        return f"{ms:.3f} ({100 * limit / ms:.0f}%)"

    cublas = cell(limit16, lambda: [F.linear(x, w) for w in w16])
    stream16 = cell(limit16, lambda: [stream_gemm(x, w, counters, torch.bfloat16) for w in w16])
    stream8 = cell(limit8, lambda: [stream_gemm(xq, q, counters, torch.bfloat16, scales=(xs, sc)) for q, sc in wq])
    return f"| [{n}, {k}] | {limit16:.3f} | {cublas} | {stream16} | {limit8:.3f} | {stream8} |"


def attn_proj(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    n, k = SHAPES[1]
    wq = [quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(args.layers)]
    wq = [(q, sc[:, 0].contiguous()) for q, sc in wq]
    ys = [torch.randn(1, 32, MAX_ROWS, k // 32, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)]
    counters = torch.zeros(counter_count(n), dtype=torch.int32, device="cuda")
    compiled = torch.compile(lambda y: quantize_rows(y.transpose(1, 2).reshape(MAX_ROWS, k)), dynamic=False)

    def joined(y: torch.Tensor, by_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if by_kernel:
            return heads_quantize(y)
        q, sc = compiled(y)
        return q, sc[:, 0]

    def chain(by_kernel: bool, gemm: bool) -> list[torch.Tensor]:
        outs = []
        for y, (q, sc) in zip(ys, wq):
            xq, xs = joined(y, by_kernel)
            outs.append(stream_gemm(xq, q, counters, torch.bfloat16, (xs, sc), prefetch=PREFETCH_TILES) if gemm else xq)
        return outs

    ref, got = chain(False, True), chain(True, True)
    diff = max(rel_diff(g, r) for g, r in zip(got, ref))
    mism = max((a.float() != b.float()).float().mean().item() for a, b in zip(chain(True, False), chain(False, False)))
    print(f"\nattention's c_proj [{n}, {k}] at {MAX_ROWS} rows, {args.layers} layers, GEMM prefetch {PREFETCH_TILES}")
    print("| join and quantize by | quantizer alone ms | with the FP8 GEMM ms | max rel diff | q mismatches |")
    print("| --- | --- | --- | --- | --- |")
    for name, by_kernel in (("compiled (Inductor)", False), ("heads_quantize", True)):
        alone = graph_ms(lambda b=by_kernel: chain(b, False))
        both = graph_ms(lambda b=by_kernel: chain(b, True))
        print(
            f"| {name} | {alone:.3f} | {both:.3f} | {diff if by_kernel else 0:.1e} | {mism if by_kernel else 0:.1e} |"
        )


def torch_confidence(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.softmax(x, -1, dtype=torch.float32).amax(-1), x.argmax(-1)


def confidence(args: argparse.Namespace) -> None:
    """Selection's row confidence: torch's softmax + amax and argmax, the Triton kernels with each
    row whole (one program per row), and as the engine splits it (kernels/row_confidence.py)."""
    dev = "cuda"
    columns = ["rows", "softmax + amax, argmax us", "one program per row us", "split us (chunks a row)", "speed-up"]
    columns += ["max rel diff", "argmax mismatches"]
    print("\n| " + " | ".join(columns) + " |\n|" + " --- |" * len(columns))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for rows in (8, 32, 64, 1024, 2048):
        x = (torch.randn(rows, 100352, device=dev) * 3).to(torch.bfloat16)
        x[:, 100281:] = float("-inf")
        x[:, 100257] = float("-inf")
        ref, ref_top = torch_confidence(x)
        got, top = row_confidence(x)
        diff = ((got - ref).abs() / ref).max().item()
        wrong = (top != ref_top).sum().item()
        tr = graph_ms(lambda x=x: torch_confidence(x), 50)
        whole = graph_ms(lambda x=x: row_confidence_split(x, 1), 50)
        tt = graph_ms(lambda x=x: row_confidence(x), 50)
        splits = splits_for(rows, sms)
        times = f"{tr * 1e3:.1f} | {whole * 1e3:.1f} | {tt * 1e3:.1f} ({splits}) | {tr / tt:.2f}x"
        print(f"| {rows} | {times} | {diff:.1e} | {wrong} |", flush=True)


# In this order, whatever --only's: the stack last, it holds 23 GB of weights.
SECTIONS = {
    "confidence": confidence,
    "act_quant": act_quant,
    "pdl_chain": pdl_chain,
    "per_shape": per_shape,
    "attn_proj": attn_proj,
    "stack": stack,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument(
        "--only", nargs="+", choices=list(SECTIONS), default=list(SECTIONS), help="these sections (default: all)"
    )
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    for name, run in SECTIONS.items():
        if name in args.only:
            run(args)


if __name__ == "__main__":
    main()
