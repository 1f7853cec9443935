"""Issue 29: the FP8 MLP of one request as one persistent kernel (kernels/stream_mlp.py) against the
three launches the engine runs (c_fc on the split-K GEMM, silu_mul_quantize, c_proj on the split-K
GEMM), on the 8b's shapes at 64 rows.

1. Agreement: the fused kernel against the three launches with the same K tiles (bit-equal
   expected) and against the autotuned launches, at 64 and 5 rows.
2. Time: the 32 layers chained as the engine runs them (each MLP's input written by the fused
   residual kernel just before it, which signals dependents), CUDA-graph replays: the three
   launches (autotuned, c_fc and c_proj with the engine's PDL prefetch) against the fused kernel
   in a few configs, beside the MLP weights' read limit.
3. Many replays of the fused chain, so a barrier that could hang shows here, not in the engine.

    python scripts/bench_fused_mlp.py [--layers 32]
"""

from __future__ import annotations

import argparse
import time

import torch
from cde.kernels.fp8_ops import PREFETCH_TILES
from cde.kernels.fp8_triton import add_norm_quantize, silu_mul_quantize
from cde.kernels.stream_gemm import counter_count, stream_gemm
from cde.kernels.stream_mlp import fp8_mlp, scratch
from cde.worker.cuda_timing import graph_replay_ms
from cde.worker.fp8 import quantize_rows

E, F = 4096, 16384  # the 8b's width and MLP width (c_fc [2F, E], c_proj [E, F])
BANDWIDTH_TB_S = 4.2


def weights(layers: int) -> list[tuple]:
    out = []
    for _ in range(layers):
        wfc, sfc = quantize_rows(torch.randn(2 * F, E, device="cuda", dtype=torch.bfloat16) * 0.02)
        wpj, spj = quantize_rows(torch.randn(E, F, device="cuda", dtype=torch.bfloat16) * 0.02)
        out.append((wfc, sfc[:, 0].contiguous(), wpj, spj[:, 0].contiguous()))
    return out


def unfused(xq, xs, w, counters, cfg_fc=None, cfg_pj=None, prefetch=0):
    wfc, sfc, wpj, spj = w
    h = stream_gemm(xq, wfc, counters[0], torch.bfloat16, scales=(xs, sfc), config=cfg_fc, prefetch=prefetch)
    q, s = silu_mul_quantize(h)
    return stream_gemm(q, wpj, counters[1], torch.bfloat16, scales=(s, spj), config=cfg_pj, prefetch=prefetch)


def gemm_cfg(bn: int, bk: int, warps: int = 4, stages: int = 4) -> dict:
    return {
        "BLOCK_M": 64,
        "BLOCK_N": bn,
        "BLOCK_K": bk,
        "SPLIT_K": 1,
        "SWAP_AB": False,
        "num_warps": warps,
        "num_stages": stages,
    }


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def agreement(ws: list[tuple], counters, state) -> None:
    print("\n| rows | fused vs same K tiles: equal, max rel diff | fused vs autotuned launches |")
    print("| --- | --- | --- |")
    for rows in (64, 5):
        x = torch.randn(rows, E, device="cuda", dtype=torch.bfloat16)
        xq, xs = quantize_rows(x)
        xs = xs[:, 0].contiguous()
        got = fp8_mlp(xq, xs, *ws[0], state, torch.bfloat16)
        same = unfused(xq, xs, ws[0], counters, gemm_cfg(128, 128), gemm_cfg(32, 256))
        tuned = unfused(xq, xs, ws[0], counters)
        again = fp8_mlp(xq, xs, *ws[0], state, torch.bfloat16)
        assert torch.equal(again, got), "the fused kernel gave other bits on a second call"
        assert not state[:64].any(), "row maxima left behind"
        print(f"| {rows} | {torch.equal(got, same)}, {rel(got, same):.1e} | {rel(got, tuned):.1e} |", flush=True)


def chain(ws, residual, fused: bool, counters, state, cfg=None, prefetch=0, phased=False):
    x, delta, norm_w = residual

    def run():
        outs = []
        for w in ws:
            _, q, s = add_norm_quantize(x, delta, norm_w, 1e-5)
            if fused:
                outs.append(fp8_mlp(q, s, *w, state, torch.bfloat16, config=cfg, prefetch=prefetch, phased=phased))
            else:
                outs.append(unfused(q, s, w, counters, prefetch=prefetch))
        return outs

    return run


def timing(ws, counters, state, layers: int) -> None:
    x = torch.randn(64, E, device="cuda", dtype=torch.bfloat16)
    residual = (x, torch.randn_like(x), torch.ones(E, device="cuda", dtype=torch.bfloat16))
    limit = layers * 3 * E * F / (BANDWIDTH_TB_S * 1e12) * 1e3
    norms = graph_replay_ms(lambda: [add_norm_quantize(*residual, 1e-5) for _ in ws])[0]
    print(f"\n{layers} layers at 64 rows, the residual kernels alone {norms:.3f} ms; MLP weights' limit {limit:.3f} ms")
    print("| variant | ms | MLP ms (less the residuals) | of the limit |")
    print("| --- | --- | --- | --- |")
    variants = [
        ("three launches, autotuned", False, None, 0, False),
        ("three launches, PDL prefetch", False, None, PREFETCH_TILES, False),
        ("fused kernel's phases as three launches", True, None, 0, True),
        ("fused kernel's phases as three launches, BN_FC 64", True, {"BN_FC": 64}, 0, True),
    ]
    for cfg in (
        {},
        {"num_stages": 5},
        {"num_warps": 8, "num_stages": 5},
        {"BN_FC": 64},
        {"BN_FC": 64, "num_stages": 3},
        {"BN_FC": 64, "BK_FC": 256, "num_stages": 3},
    ):
        variants.append((f"fused {cfg or 'default'}", True, cfg, 0, False))
    variants.append(("fused default, PDL prefetch", True, None, PREFETCH_TILES, False))
    for name, fused, cfg, prefetch, phased in variants:
        try:
            ms = graph_replay_ms(chain(ws, residual, fused, counters, state, cfg, prefetch, phased))[0]
        except Exception as e:  # a config that does not build on this card
            print(f"| {name} | {type(e).__name__}: {str(e)[:80]} | | |", flush=True)
            continue
        print(f"| {name} | {ms:.3f} | {ms - norms:.3f} | {100 * limit / (ms - norms):.0f}% |", flush=True)


def soak(ws, counters, state, seconds: float = 20.0) -> None:
    x = torch.randn(64, E, device="cuda", dtype=torch.bfloat16)
    residual = (x, torch.randn_like(x), torch.ones(E, device="cuda", dtype=torch.bfloat16))
    run = chain(ws, residual, True, counters, state)
    first = [o.clone() for o in run()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    start, calls = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        for _ in range(50):
            graph.replay()
        calls += 50 * len(ws)
        torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(outs, first))
    print(f"\nsoak: {calls} fused calls in {seconds:.0f} s, no hang; last replay equals the first eager call: {same}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=32)
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    torch.manual_seed(0)
    ws = weights(args.layers)
    counters = [torch.zeros(counter_count(n), dtype=torch.int32, device="cuda") for n in (2 * F, E)]
    state = scratch("cuda")
    agreement(ws, counters, state)
    timing(ws, counters, state, args.layers)
    soak(ws, counters, state)


if __name__ == "__main__":
    main()
