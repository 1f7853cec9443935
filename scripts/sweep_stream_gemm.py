"""Issue 29: every launch config of the split-K GEMM (kernels/stream_gemm.py) at one request,
timed as the engine runs it, beside the config the autotuner picks at warm-up.

Per weight shape of the 8b (c_attn, attention's c_proj, c_fc, the MLP's c_proj) and dtype (FP8 with
row scales, bfloat16): the shape's 32 distinct layer weights back to back at 64 rows, replayed from
a CUDA graph (so the weights stream from HBM and no host launch is timed), once per config in a
grid wider than the autotuner's (8 warps, 512-wide K tiles, 3-stage split shares, CTA clusters). Each config's
output is checked against the autotuned call's first. The autotuner times eager calls of one
weight; if its pick is far from the graph-timed best, the warm-up should time graphs instead.

    python scripts/sweep_stream_gemm.py [--dtypes fp8 bf16] [--budget-s 240] [--top 5]
    python scripts/sweep_stream_gemm.py --timeline   # where each GEMM's time goes, CTA by CTA
    python scripts/sweep_stream_gemm.py --grid tma   # the tiles loaded by TMA (or: --grid clusters)
"""

from __future__ import annotations

import argparse
import itertools
import random
import time

import torch
from bench_fp8_kernels import SHAPES as FP8_KERNEL_SHAPES  # scripts/: the 8b's four weight shapes
from cde.kernels.stream_gemm import MAX_ROWS, counter_count, stream_gemm, tuned_launch_configs
from cde.kernels.stream_gemm_configs import pipeline_bytes, shared_limit
from cde.worker.cuda_timing import graph_replay_ms
from cde.worker.fp8 import quantize_rows

from cde.commands.bench_roofline import this_card_bandwidth

SHAPES = dict(zip(("c_attn", "attn c_proj", "c_fc", "mlp c_proj"), FP8_KERNEL_SHAPES))


def configs(elem_bytes: int) -> list[dict]:
    """The grid: every tile and split whose pipeline fits shared memory (weight and activation
    tiles); and unsplit tiles shared by a cluster of 2 or 4 CTAs (Hopper's `num_ctas`: each CTA
    computes a slice of the tile's columns, and the cluster may share the activation tile, which
    every CTA of a one-request GEMM otherwise reads from L2 for itself)."""

    def fits(c: dict) -> bool:  # a cluster's CTA holds its slice of the tile's columns
        return pipeline_bytes({**c, "BLOCK_N": c["BLOCK_N"] // c["num_ctas"]}, elem_bytes, elem_bytes) <= shared

    shared = shared_limit(torch.device("cuda"))
    out = []
    for bn, bk, sk, warps in itertools.product((32, 64, 128), (128, 256, 512), (1, 2, 4, 8), (4, 8)):
        for stages in (4, 6, 8) if sk == 1 else (3, 4, 6):
            out.append(config(bn, bk, sk, warps, stages))
    for ctas, bn, bk, stages in itertools.product((2, 4), (64, 128, 256), (128, 256), (4, 6)):
        out.append(config(bn, bk, 1, 4, stages, ctas))
    out = [c for c in out if fits(c)]
    random.Random(0).shuffle(out)  # a budget cut leaves a random sample of the grid, not one corner
    return out


def config(bn: int, bk: int, sk: int, warps: int, stages: int, ctas: int = 1) -> dict:
    return {
        "BLOCK_M": MAX_ROWS,
        "BLOCK_N": bn,
        "BLOCK_K": bk,
        "SPLIT_K": sk,  # a cluster's CTAs would each count a split tile's shares: unsplit only
        "SWAP_AB": False,
        "num_warps": warps,
        "num_stages": stages,
        "num_ctas": ctas,
    }


def label(c: dict) -> str:
    cluster = f" c{c['num_ctas']}" if c.get("num_ctas", 1) > 1 else ""
    tma = " tma" if c.get("TMA") else ""
    return f"n{c['BLOCK_N']} k{c['BLOCK_K']} s{c['SPLIT_K']} w{c['num_warps']} st{c['num_stages']}{cluster}{tma}"


def shape_setup(n: int, k: int, dtype: str, layers: int, prefetch: int = 0):
    """The shape's layer weights, a call(w, config, **stream_gemm's keywords) on them, and the
    weights' bytes per element."""
    torch.manual_seed(0)
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    x = torch.randn(MAX_ROWS, k, device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(counter_count(n), dtype=torch.int32, device="cuda")
    if dtype == "bf16":
        return (
            w16,
            lambda w, config=None, **kw: stream_gemm(
                x, w, counters, torch.bfloat16, config=config, prefetch=prefetch, **kw
            ),
            2,
        )
    weights = [(q, sc[:, 0].contiguous()) for q, sc in (quantize_rows(w) for w in w16)]
    xq, xs = quantize_rows(x)
    xs = xs[:, 0].contiguous()

    def call(w, config=None, **kw):
        return stream_gemm(
            xq, w[0], counters, torch.bfloat16, scales=(xs, w[1]), config=config, prefetch=prefetch, **kw
        )

    return weights, call, 1


def grid_of(kind: str, elem_bytes: int) -> list[dict]:
    """`all`: the grid; `clusters`: its CTA-cluster configs; `tma`: its single-CTA configs with the
    tiles loaded by the tensor memory accelerator (bulk copies) instead of per-thread loads."""
    grid = configs(elem_bytes)
    if kind == "clusters":
        return [c for c in grid if c["num_ctas"] > 1]
    if kind == "tma":
        return [{**c, "TMA": True} for c in grid if c["num_ctas"] == 1]
    return grid


def sweep(dtype: str, shapes: list[str], layers: int, budget_s: float, top: int, kind: str, prefetch: int) -> None:
    """Configs outer, shapes inner: a budget cut leaves every shape with the same configs timed.
    `prefetch` > 0: every call launched early (PDL) with that many weight tiles to L2, as the
    engine's FP8 calls are."""
    setups = {name: shape_setup(*SHAPES[name], dtype, layers, prefetch) for name in shapes}
    grid = grid_of(kind, setups[shapes[0]][2])
    print(f"\n== {dtype}: {len(grid)} configs", flush=True)
    refs, rows = {}, {name: [] for name in shapes}
    for name, (weights, call, _) in setups.items():
        refs[name] = call(weights[0])  # the autotuner's pick, made here as at the engine's warm-up
        rows[name].append((graph_replay_ms(lambda w=weights, c=call: [c(x) for x in w])[0], None, "autotuned"))
    deadline = time.monotonic() + budget_s
    for i, config in enumerate(grid):
        if time.monotonic() > deadline:
            print(f"  (budget spent after {i} of {len(grid)} configs)")
            break
        for name, (weights, call, _) in setups.items():
            try:
                got = call(weights[0], config)
            except Exception as e:  # a config Triton cannot build on this card (shared memory, registers)
                print(f"  {label(config)}: {type(e).__name__}")
                break
            ref = refs[name].float()
            err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
            ms = graph_replay_ms(lambda w=weights, c=call, g=config: [c(x, g) for x in w])[0]
            rows[name].append((ms, config, f"max rel diff {err:.1e}"))
    tuned = {key[:3]: c for key, c in tuned_launch_configs().items()}
    for name in shapes:
        n, k = SHAPES[name]
        elem = setups[name][2]
        limit = layers * n * k * elem / (this_card_bandwidth() * 1e12) * 1e3
        print(f"\n{dtype} {name} [{n}, {k}], {layers} layers at {MAX_ROWS} rows: limit {limit:.3f} ms")
        for ms, config, note in sorted(rows[name], key=lambda r: r[0])[:top] + rows[name][:1]:
            shown = label(config or tuned[(n, k, dtype == "fp8")])
            print(f"  {ms:.3f} ms ({100 * limit / ms:.0f}%)  {shown}  {note}")
    del setups
    torch.cuda.empty_cache()


def chain_stats(raw: torch.Tensor) -> list[float]:
    """raw [GEMMs, CTA rows, 4] int64 timelines (unused rows zero) -> the medians over the chain's
    GEMMs after the first of: CTAs, gap, stagger, cta, epilogue, tail, span (us; `timelines`)."""
    ran = raw[..., 0] > 0
    t = (raw[..., :3] - raw[..., 0][ran].min()).double() / 1e3  # us since the chain's first CTA started
    rows = []
    for i in range(1, raw.shape[0]):
        cur, prev = t[i][ran[i]], t[i - 1][ran[i - 1]]
        first, last = cur[:, 0].min(), cur[:, 2].max()
        cells = [
            first - prev[:, 2].max(),
            cur[:, 0].max() - first,
            (cur[:, 2] - cur[:, 0]).median(),
            (cur[:, 2] - cur[:, 1]).median(),
            last - cur[:, 2].median(),
            last - first,
        ]
        rows.append([float(len(cur))] + [float(c) for c in cells])
    return torch.tensor(rows).median(0).values.tolist()


def timelines(dtype: str, shapes: list[str], layers: int) -> None:
    """Each CTA's start, K-loop end and end (%globaltimer) in the autotuned chain of every shape,
    from one graph replay: where a one-request GEMM's time beyond its bytes goes. Per GEMM of the
    chain (the first left out): `gap`, its first CTA's start after the GEMM before ended; `stagger`,
    its last CTA's start after its first; `cta`, a CTA's median time; `epilogue`, its median time
    after the K loop; `tail`, the GEMM's end after its median CTA's end; `span`, first start to
    last end; `bytes at`, its weight bytes over its span."""
    print(
        f"\n| {dtype} shape | CTAs | gap us | stagger us | cta us | epilogue us | tail us | span us | bytes at TB/s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in shapes:
        n, k = SHAPES[name]
        weights, call, elem = shape_setup(n, k, dtype, layers)
        call(weights[0])  # the autotuner's pick
        books = [torch.zeros(counter_count(n) * 8, 4, dtype=torch.int64, device="cuda") for _ in weights]
        graph_replay_ms(lambda c=call, ws=weights, bs=books: [c(w, timeline=t) for w, t in zip(ws, bs)])
        m = chain_stats(torch.stack(books).cpu())
        rate = n * k * elem / (m[6] * 1e-6) / 1e12
        shown = " | ".join(f"{v:.1f}" for v in m[1:])
        print(f"| {name} | {m[0]:.0f} | {shown} | {rate:.2f} |", flush=True)
        del weights, books
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--budget-s", type=float, default=240.0, help="per dtype: the configs after it are not timed")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--timeline", action="store_true", help="the autotuned chains' CTA timelines instead of the sweep")
    p.add_argument("--grid", default="all", choices=["all", "clusters", "tma"], help="see grid_of")
    p.add_argument("--prefetch", type=int, default=0, help="weight tiles to L2 before gdc_wait (PDL launches)")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    for dtype in args.dtypes:
        if args.timeline:
            timelines(dtype, args.shapes, args.layers)
        else:
            sweep(dtype, args.shapes, args.layers, args.budget_s, args.top, args.grid, args.prefetch)


if __name__ == "__main__":
    main()
