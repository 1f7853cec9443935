"""Offline engine benchmark: latency and throughput per concurrency, no HTTP in the way."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import random
import tempfile
import time
from typing import TYPE_CHECKING, Any

import torch

from cde.cli_types import kv_splits
from cde.commands import bench_constrained, bench_flashblock
from cde.commands.bench_constrained import constrain, group_rates, variants
from cde.commands.bench_instruments import GcClock, StepClock, profile_steps
from cde.commands.bench_watch import Watch
from cde.commands.config_overrides import add_config_overrides, config_overrides
from cde.commands.inductor_overrides import add_inductor_overrides, apply_inductor_overrides, parse_inductor_overrides
from cde.commands.model_args import add_model_arguments, resolve_model_args
from cde.commands.settings_builder import engine_args
from cde.commands.worker import (
    DEVICE_HELP,
    DEVICES,
    DTYPE_HELP,
    DTYPES,
    add_async_scheduling_arguments,
    add_quantization_arguments,
    check_quantization_device,
)
from cde.shared.config import PAGE
from cde.shared.limits import MAX_TOKENS_PER_STEP
from cde.shared.logs import setup_logging
from cde.shared.protocol import AttributionSpec, GenerateRequest, SteeringSpec
from cde.worker.checkpoint import make_model
from cde.worker.devices import resolve_device
from cde.worker.engine import Engine

if TYPE_CHECKING:
    from cde.shared.protocol import FlashBlockSpec
    from cde.shared.settings import EngineArgs


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    add_model_arguments(p, into=src)
    src.add_argument(
        "--preset",
        help="write a random-weight checkpoint of this preset first (e.g. 8b; default: --model's checkpoint)",
    )
    p.add_argument("--concurrency", default="1,4,16,32", help="comma-separated request counts")
    p.add_argument("--prompt-len", default="64", help="comma-separated prompt lengths, each run at every concurrency")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens each request generates")
    p.add_argument(
        "--tokens-per-step",
        default="1",
        help="comma-separated tokens unmasked per denoising step, each run at every concurrency "
        "(the mechanical throughput of multi-token steps; their accuracy is the reference-model benchmark's)",
    )
    p.add_argument("--attribution", action="store_true", help="every request asks for attribution")
    p.add_argument(
        "--compare-attribution",
        action="store_true",
        help="run each level twice in the same engine: without, then with attribution",
    )
    p.add_argument(
        "--steering",
        action="store_true",
        help="run each level twice in the same engine: no steering, then half of the requests steering",
    )
    p.add_argument("--device", default="auto", choices=DEVICES, help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--no-cuda-graphs", action="store_true", help="CUDA: run passes eagerly, without captured graphs")
    p.add_argument(
        "--kv-splits",
        type=kv_splits,
        default=0,
        help="split-KV attention ways at batch 1 (as `cde serve --kv-splits`; 0: chosen per pass)",
    )
    p.add_argument("--json", help="write the results as JSON here (default: only the table)")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="also profile 32 steps in each of the first two blocks of every level; op tables to "
        "DIR/profile-c{N}.txt (default: off)",
    )
    p.add_argument(
        "--watch",
        type=float,
        default=0,
        metavar="S",
        help="every S seconds, the engine's progress on stderr, and every thread's stack when no pass "
        "ran for S seconds: a run that does not finish says why (default: off)",
    )
    add_config_overrides(p)  # with --preset
    add_inductor_overrides(p)
    add_quantization_arguments(p)
    add_async_scheduling_arguments(p)
    p.add_argument(
        "--compare-async-scheduling",
        action="store_true",
        help="run each level twice in the same engine: each pass planned after the last one's picks, then ahead "
        "of them",
    )
    bench_flashblock.add_arguments(p)
    bench_constrained.add_arguments(p)


def _requests(
    n: int,
    args: argparse.Namespace,
    tag: str,
    steer: bool = False,
    attribution: bool | None = None,
    flashblock: FlashBlockSpec | bool | None = None,
    prompt_len: int | None = None,
) -> list[GenerateRequest]:
    attribution = args.attribution if attribution is None else attribution
    rng = random.Random(n)
    reqs = []
    for i in range(n):
        reqs.append(
            GenerateRequest(
                f"{tag}-{i}",
                [rng.randrange(1000, 100000) for _ in range(prompt_len or args.prompt_len)],
                max_tokens=args.max_tokens,
                tokens_per_step=args.tokens_per_step,
                attribution=AttributionSpec() if attribution else None,
                steering=SteeringSpec(concepts=[i % 7, 11], inject_layer=args.steer_layer)
                if steer and i % 2 == 0
                else None,
                flashblock=flashblock,
            )
        )
    return reqs


def _run(engine: Engine, reqs: list[GenerateRequest]) -> dict:
    clock, gc_clock = StepClock(engine), GcClock()
    if clock.cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    blocks: dict[str, list[float]] = {r.request_id: [] for r in reqs}
    outputs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    generated, decode_s, first_block_passes = 0, 0.0, None
    while engine.has_work():
        t0 = time.perf_counter()
        results = engine.step()
        if clock.last_decode:
            decode_s += time.perf_counter() - t0
        if results and first_block_passes is None:
            first_block_passes = clock.finished
        for res in results:
            blocks[res.request_id].append(time.perf_counter() - start)
            outputs[res.request_id] += res.token_ids
            generated += len(res.token_ids)
    wall = time.perf_counter() - start
    device, idle_ms = clock.device_ms()
    clock.restore()
    gc_clock.stop()
    first = [b[0] for b in blocks.values()]
    gaps = [y - x for b in blocks.values() for x, y in zip(b, b[1:])]
    steps = len(device)
    n_blocks = sum(len(b) for b in blocks.values())
    return {
        "concurrency": len(reqs),
        "time_to_first_block_s": sum(first) / len(first),
        "inter_block_latency_s": sum(gaps) / len(gaps) if gaps else 0.0,
        "time_to_last_block_s": sum(b[-1] for b in blocks.values()) / len(blocks),
        "output_tok_per_s": generated / wall,
        "decode_tok_per_s": generated / decode_s if decode_s else None,  # passes without prefill only
        "ms_per_forward": sum(device) / steps,
        # Passes up to the first completed block, and after it: a step that grows dearer as the
        # context grows shows here.
        "ms_per_forward_first_block": _mean(device[:first_block_passes]),
        "ms_per_forward_after": _mean(device[first_block_passes:]),
        "forward_passes_per_block": steps * len(reqs) / n_blocks,
        "gpu_idle_fraction": idle_ms / 1e3 / wall,  # between passes, waiting for the host's launch
        "forward_passes": steps,
        "tokens_per_forward": generated / steps,  # tokens committed per pass, all requests together
        "generated_tokens": generated,
        "wall_s": wall,
        "peak_device_gb": torch.cuda.max_memory_allocated() / 2**30 if clock.cuda else None,
        "gc_collections": gc_clock.count,
        "gc_ms": gc_clock.seconds * 1e3,
        "outputs": outputs,
        "last_block_s": {rid: b[-1] for rid, b in blocks.items() if b},
    }


def _int_list(text: str, flag: str, lo: int, hi: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"cde bench engine: {flag} takes comma-separated integers, got {text!r}") from None
    if not all(lo <= v <= hi for v in values):
        raise SystemExit(f"cde bench engine: {flag} values must be in [{lo}, {hi}], got {text!r}")
    return values


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _compile_count() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["stats"].values()) if "stats" in counters else 0


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    # The bench's own --kv-splits; its FlashBlock knobs are per request (bench_flashblock).
    engine_settings = engine_args(args, device=device, cuda_graphs=not args.no_cuda_graphs, kv_splits=args.kv_splits)
    check_quantization_device(engine_settings.quantization, device)
    tokens_per_step = _int_list(args.tokens_per_step, "--tokens-per-step", 1, MAX_TOKENS_PER_STEP)
    inductor = parse_inductor_overrides(args.inductor)
    if args.preset is None:
        resolve_model_args(args, "bench engine")
    if args.model is not None:
        return _bench(args, args.model, device, engine_settings, tokens_per_step, inductor)
    # A random checkpoint lives as long as its run (an 8b preset is 16 GB of /tmp).
    with tempfile.TemporaryDirectory(prefix=f"cde-{args.preset}-") as model_dir:
        dtype = "bfloat16" if device == "cuda" else "float32"
        t0 = time.perf_counter()
        make_model(args.preset, model_dir, seed=0, dtype=dtype, device=device, overrides=config_overrides(args))
        print(f"wrote random {args.preset} checkpoint to {model_dir} in {time.perf_counter() - t0:.1f}s", flush=True)
        return _bench(args, model_dir, device, engine_settings, tokens_per_step, inductor)


def _bench(
    args: argparse.Namespace,
    model_dir: str,
    device: str,
    engine_settings: EngineArgs,
    tokens_per_step: list[int],
    inductor: dict[str, Any],
) -> int:
    levels = [int(x) for x in args.concurrency.split(",")]
    prompt_lens = [int(x) for x in args.prompt_len.split(",")]
    # Warnings, and the engine's startup choices for one request's linears (cuBLAS or Triton per
    # shape, with both timings; each shape's GEMM config timed over its layers), in the bench's
    # log as JSON lines on stderr.
    setup_logging("bench", "warning")
    for name in ("cde.stream_linear", "cde.gemm_tuning"):
        logging.getLogger(name).setLevel(logging.INFO)
    apply_inductor_overrides(inductor)
    t0 = time.perf_counter()
    engine = Engine(dataclasses.replace(engine_settings, model=model_dir, max_running=max(levels)))
    print(f"engine loaded and warmed up in {time.perf_counter() - t0:.1f}s", flush=True)
    args.steer_layer = engine.cfg.n_layers // 4  # layer 8 of the 8B's 32
    with Watch(engine, args.watch) if args.watch else contextlib.nullcontext():
        results = _levels(engine, args, levels, prompt_lens, tokens_per_step, device)
        if args.flashblock_tau is not None:
            bench_flashblock.print_table(results)
        else:
            print_table(results)
        for res in results:
            res.pop("outputs"), res.pop("last_block_s")
        if args.json:
            settings = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None), list))}
            report = {"args": settings, "device": device_name(device), "config": dataclasses.asdict(engine.cfg)}
            with open(args.json, "w") as f:  # the model's config too: a random checkpoint's directory is temporary
                json.dump({**report, "results": results}, f, indent=2)
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
            for c in levels:
                profile_steps(engine, _requests(c, args, f"prof{c}"), os.path.join(args.profile, f"profile-c{c}.txt"))
    return 0


def device_name(device: str) -> str:
    """The card a run's figures belong to (`cde bench roofline` takes its limits from it)."""
    return torch.cuda.get_device_name() if device == "cuda" else device


def print_table(results: list[dict]) -> None:
    cols = [
        ("concurrency", "conc", "{:d}"),
        ("output_tok_per_s", "tok/s", "{:.1f}"),
        ("ms_per_forward", "ms/fwd", "{:.2f}"),
        ("ms_per_forward_first_block", "ms/fwd 1st block", "{:.2f}"),
        ("ms_per_forward_after", "ms/fwd after", "{:.2f}"),
        ("time_to_first_block_s", "TTFB s", "{:.3f}"),
        ("inter_block_latency_s", "ITL s", "{:.3f}"),
        ("time_to_last_block_s", "TTLB s", "{:.2f}"),
        ("forward_passes_per_block", "fwd/block", "{:.1f}"),
        ("tokens_per_step", "tok/step", "{:d}"),
        ("tokens_per_forward", "tok/fwd", "{:.2f}"),
        ("gpu_idle_fraction", "idle", "{:.2f}"),
        ("recompiles_after_warmup", "recomp", "{:d}"),
        ("steering_half", "steer", "{}"),
        ("attribution", "attr", "{}"),
        ("constrained", "grammar", "{}"),
        ("async_scheduling", "async", "{}"),
        ("gc_ms", "GC ms", "{:.1f}"),
        ("peak_device_gb", "peak GB", "{:.1f}"),
        ("quantization", "quant", "{}"),
    ]
    print(" | ".join(h for _, h, _ in cols))
    for r in results:
        print(" | ".join("—" if r[k] is None else f.format(r[k]) for k, _, f in cols))


def _levels(
    engine: Engine,
    args: argparse.Namespace,
    levels: list[int],
    prompt_lens: list[int],
    tokens_per_step: list[int],
    device: str,
) -> list[dict]:
    """Every (prompt length, tokens per step, concurrency) level, warmed then measured."""
    results: list[dict] = []
    for plen, tps, c in [(p, t, c) for p in prompt_lens for t in tokens_per_step for c in levels]:
        args.prompt_len, args.tokens_per_step = plen, tps
        # Warm every variant the level will run, so compilation stays out of the measurement.
        # (FlashBlock runs measure decoding: their warm-up skips the long prefill.)
        warm = _requests(
            c,
            args,
            f"warm{c}",
            steer=args.steering,
            attribution=args.attribution or args.compare_attribution,
            prompt_len=PAGE if args.flashblock_tau is not None else None,
        )
        # Two blocks reach every path of a pass (the prompt's tail block, a commit, a fresh block);
        # on the CPU nothing is compiled or captured, and one block warms the host side enough.
        warm_blocks = 1 if device == "cpu" else 2
        for r in warm:
            r.max_tokens = min(args.max_tokens, warm_blocks * PAGE)
        _run(engine, warm)  # the engine captured its graphs at startup; this warms the host side
        if args.flashblock_tau is not None:
            for res in bench_flashblock.run_level(
                engine, args, c, lambda n, tag, fb, **kw: _requests(n, args, tag, flashblock=fb, **kw), _run
            ):
                res["context"] = args.prompt_len + args.max_tokens
                results.append(res)
                print(json.dumps({k: v for k, v in res.items() if k not in ("outputs", "last_block_s")}), flush=True)
            continue
        attrs = [False, True] if args.compare_attribution else [args.attribution]
        aheads = [False, True] if args.compare_async_scheduling else [engine.plans_ahead]
        steers = [False, True] if args.steering else [False]
        runs = [(s, a, v, h) for s in steers for a in attrs for v in variants(args) for h in aheads]
        for steer, attr, variant, ahead in runs:
            before = _compile_count()
            reqs = constrain(_requests(c, args, f"run{c}{steer}{attr}{variant}{ahead}", steer, attr), variant)
            engine.plans_ahead = ahead
            res = _run(engine, reqs)
            res["recompiles_after_warmup"] = _compile_count() - before
            res["steering_half"], res["attribution"], res["constrained"] = steer, attr, variant
            res["async_scheduling"] = ahead
            if ahead and args.compare_async_scheduling:  # the same requests, planned after the picks: the same tokens
                res["outputs_match_sync"] = list(res["outputs"].values()) == list(results[-1]["outputs"].values())
            res.update(group_rates(res, reqs))
            res["tokens_per_step"], res["quantization"] = tps, args.quantization
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k not in ("outputs", "last_block_s")}), flush=True)
    return results
