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
   dependent launch and its first 1-8 weight tiles prefetched to L2 while that kernel runs; then
   (l2_next) each GEMM sending the next one's first 4-48 MB of weight to L2 as it finishes.
4. Selection's confidence and greedy token over [rows, 100352] bfloat16 logits: softmax + amax and
   argmax against the kernel.

    python scripts/bench_fp8_kernels.py [--layers 32] [--only SECTION...]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from cde.kernels.fp8_ops import PREFETCH_TILES
from cde.kernels.fp8_triton import add_norm_quantize, silu_mul_quantize
from cde.kernels.row_confidence import row_confidence
from cde.kernels.stream_gemm import MAX_ROWS, counter_count, stream_gemm, tuned_configs, tuned_launch_configs
from cde.kernels.stream_ops import rms_norm, swiglu
from cde.worker.cuda_timing import graph_replay_ms
from cde.worker.fp8 import quantize_rows

SHAPES = [(5120, 4096), (4096, 4096), (32768, 4096), (4096, 16384)]  # c_attn, attn c_proj, c_fc, mlp c_proj
BANDWIDTH_TB_S = 4.2  # the H200's measured copy bandwidth (cde bench roofline's default)


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
    limit16, limit8 = (weights * b / (BANDWIDTH_TB_S * 1e12) * 1e3 for b in (2, 1))
    print(f"weight-read limit of the stack at {BANDWIDTH_TB_S} TB/s: bf16 {limit16:.3f} ms, fp8 {limit8:.3f} ms")
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


class LinearChain:
    """The 8b's linear stack at one request (64 rows) chained as the engine runs it: 32 layers of
    distinct weights (nothing stays in L2 between replays), each GEMM's input written by the fused
    residual kernel just before it, optionally with a spin of `window_us` after attention's c_attn
    (the engine's QKV + RoPE, attention and quantization run there). FP8 weights with quantized
    rows, or bfloat16 with bfloat16 rows."""

    def __init__(self, layers: int, fp8: bool = True):
        dev = "cuda"
        torch.manual_seed(0)
        self.fp8 = fp8
        self.weights = []  # in pass order: (weight, its channel scales or None)
        for _ in range(layers):
            for n, k in SHAPES:
                w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
                q, s = quantize_rows(w) if fp8 else (w, None)
                self.weights.append((q, None if s is None else s[:, 0].contiguous()))
        self.counters = {n: torch.zeros(counter_count(n), dtype=torch.int32, device=dev) for n, _ in SHAPES}
        self.ins = {
            k: (
                *(torch.randn(MAX_ROWS, k, device=dev, dtype=torch.bfloat16) for _ in "xd"),
                torch.rand(k, device=dev) + 0.5,
            )
            for _, k in SHAPES
        }
        self.configs: dict[int, dict] = {}  # per weight: the plain launch's autotuned config

    def run(
        self,
        prefetch: int | None,
        next_bytes: int = 0,
        window_us: float = 0.0,
        fixed: bool = True,
        cublas: bool = False,
    ) -> list[torch.Tensor]:
        """prefetch None: the residual kernels (and windows) alone. `fixed`: every GEMM in the plain
        launch's autotuned config (the autotuner's own choice otherwise). `cublas` (bfloat16):
        F.linear instead of the Triton GEMM."""
        outs = []
        for i, (w, s) in enumerate(self.weights):
            x, d, g = self.ins[w.shape[1]]
            out, xq, xs = add_norm_quantize(x, d, g.to(x.dtype), 1e-5)
            if prefetch is not None and cublas:
                outs.append(F.linear(out, w))
            elif prefetch is not None:
                after = self.weights[i + 1][0] if i + 1 < len(self.weights) else None
                outs.append(
                    stream_gemm(
                        xq if self.fp8 else out,
                        w,
                        self.counters[w.shape[0]],
                        torch.bfloat16,
                        (xs, s) if self.fp8 else None,
                        self.configs.get(w.shape[0]) if fixed else None,
                        prefetch=prefetch,
                        prefetch_next=after,
                        prefetch_next_bytes=next_bytes,
                    )
                )
            if window_us and i % len(SHAPES) == 0:  # after c_attn
                torch.cuda._sleep(int(window_us * CYCLES_PER_US))
        return outs

    def fix_configs(self) -> None:
        """Every later `run(fixed=True)` takes the configs the plain launch autotuned to."""
        for key, config in tuned_launch_configs().items():
            if key[0] in {n for n, _ in SHAPES} and key[2] == self.fp8 and key[5] == 0 and not key[6]:  # plain
                self.configs[key[0]] = config


CYCLES_PER_US = 1980  # torch.cuda._sleep spins in SM clock cycles: the H200's boost clock


def pdl_chain(args: argparse.Namespace) -> None:
    chain = LinearChain(args.layers)
    alone = graph_ms(lambda: chain.run(None))
    ref = chain.run(0)
    chain.fix_configs()
    print(
        f"\n{args.layers} layers x 4 (residual kernel, FP8 GEMM) at {MAX_ROWS} rows; "
        f"the residual kernels alone {alone:.3f} ms"
    )
    print("| prefetched tiles (0: plain launch) | ms | ms less the residual kernels | max rel diff to plain |")
    print("| --- | --- | --- | --- |")
    for prefetch in (0, 1, 2, 4, 8):
        diff = max(rel_diff(g, r) for g, r in zip(chain.run(prefetch), ref))
        ms = graph_ms(lambda p=prefetch: chain.run(p))
        print(f"| {prefetch} | {ms:.3f} | {ms - alone:.3f} | {diff:.1e} |", flush=True)
    print("autotuned stream_gemm configs: " + "; ".join(f"{k}: {v}" for k, v in tuned_configs()))


def l2_next(args: argparse.Namespace) -> None:
    """Each GEMM sends the start of every row of the next one's weight to L2 as it finishes
    (kernels/l2_prefetch.py; the engine sends AHEAD_BYTES), autotuned as the engine does, without
    and with a 10 us window after c_attn: FP8 with the engine's PREFETCH_TILES; then bfloat16
    (no PDL tiles: in the engine compiled kernels precede its GEMMs) beside cuBLAS, which the
    engine's bfloat16 one-request linears run where it is faster alone."""
    for fp8 in (True, False):
        ahead_table(LinearChain(args.layers, fp8))  # one chain's weights at a time
        torch.cuda.empty_cache()


def ahead_table(chain: LinearChain) -> None:
    tiles = PREFETCH_TILES if chain.fp8 else 0
    ref = chain.run(tiles, fixed=False)
    print(
        f"\n{len(chain.weights) // len(SHAPES)} layers x 4 (residual kernel, {'FP8' if chain.fp8 else 'bfloat16'} "
        f"GEMM) at {MAX_ROWS} rows, {tiles} tiles prefetched; each GEMM sends MB of the next weight (every "
        "row's start) to L2"
    )
    print("| window after c_attn us | the kernels but the GEMMs ms | GEMMs | next MB | ms | GEMMs ms | max rel diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for window in (0.0, 10.0):
        alone = graph_ms(lambda w=window: chain.run(None, window_us=w))
        runs = [
            ("Triton", mb, lambda w=window, b=mb << 20: chain.run(tiles, b, w, fixed=False))
            for mb in (0, 4, 8, 16, 24, 32, 48)
        ]
        if not chain.fp8:
            runs.insert(0, ("cuBLAS", 0, lambda w=window: chain.run(0, window_us=w, cublas=True)))
        for name, mb, run in runs:
            diff = max(rel_diff(g, r) for g, r in zip(run(), ref))
            ms = graph_ms(run)
            print(
                f"| {window:.0f} | {alone:.3f} | {name} | {mb} | {ms:.3f} | {ms - alone:.3f} | {diff:.1e} |",
                flush=True,
            )


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


def torch_confidence(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.softmax(x, -1, dtype=torch.float32).amax(-1), x.argmax(-1)


def confidence(args: argparse.Namespace) -> None:
    dev = "cuda"
    print("\n| rows | softmax + amax, argmax us | Triton us | speed-up | max rel diff | argmax mismatches |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in (64, 1024, 2048):
        x = (torch.randn(rows, 100352, device=dev) * 3).to(torch.bfloat16)
        x[:, 100281:] = float("-inf")
        x[:, 100257] = float("-inf")
        ref, ref_top = torch_confidence(x)
        got, top = row_confidence(x)
        diff = ((got - ref).abs() / ref).max().item()
        wrong = (top != ref_top).sum().item()
        tr = graph_ms(lambda x=x: torch_confidence(x), 50)
        tt = graph_ms(lambda x=x: row_confidence(x), 50)
        print(f"| {rows} | {tr * 1e3:.1f} | {tt * 1e3:.1f} | {tr / tt:.2f}x | {diff:.1e} | {wrong} |", flush=True)


SECTIONS = {
    "confidence": confidence,
    "act_quant": act_quant,
    "pdl_chain": pdl_chain,
    "l2_next": l2_next,
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
    for name in SECTIONS:  # in this order, whatever --only's: the stack last, it holds 23 GB of weights
        if name in args.only:
            SECTIONS[name](args)


if __name__ == "__main__":
    main()
