"""Write a random-weight Steerling checkpoint of a preset shape in the published layout."""

from __future__ import annotations

import argparse
from pathlib import Path

from cde.commands.config_overrides import add_config_overrides, config_overrides
from cde.commands.worker import worker_device
from cde.shared.config import PRESETS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="output directory")
    p.add_argument("--preset", choices=sorted(PRESETS), required=True, help="model shape (required)")
    p.add_argument("--instruct", action="store_true", help="instruct vocabulary (100284) and chat template")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument(
        "--dtype", choices=["bfloat16", "float16", "float32"], default="float32", help="dtype the weights are stored in"
    )
    p.add_argument(
        "--device",
        type=worker_device,
        default="cpu",
        help="where to generate the weights: auto | cpu | cuda | cuda:N (cuda is much faster for 8b)",
    )
    p.add_argument("--max-shard-gb", type=float, default=4.0, help="largest safetensors shard, in GiB")
    p.add_argument("--force", action="store_true", help="replace a checkpoint already in the output directory")
    add_config_overrides(p)


def run(args: argparse.Namespace) -> int:
    from cde.worker.checkpoint import make_model
    from cde.worker.devices import resolve_device

    held = [f.name for f in sorted(Path(args.out).glob("*")) if f.name == "config.json" or ".safetensors" in f.name]
    if held and not args.force:
        raise SystemExit(f"{args.out} already holds a checkpoint ({', '.join(held[:3])}); --force replaces it")

    out = make_model(
        args.preset,
        args.out,
        seed=args.seed,
        dtype=args.dtype,
        instruct=args.instruct,
        max_shard_bytes=int(args.max_shard_gb * (1 << 30)),
        device=resolve_device(args.device),
        overrides=config_overrides(args),
    )
    print(out)
    return 0
