"""The one place a command's flags and the environment become the engine's settings (EngineArgs,
WorkerSettings: shared/settings.py). Each check of a flag runs here, before any model work, so a
bad flag fails once, in the command that was given it, not in every worker it starts."""

from __future__ import annotations

import argparse
import os
from typing import Any

from cde.shared.limits import check_flashblock
from cde.shared.protocol import FlashBlockSpec
from cde.shared.settings import EngineArgs, WorkerSettings

# Environment knobs of input attribution (docs/api.md): read here, once, never in a constructor.
INPUT_ATTRIBUTION_TOKENS_ENV = "CDE_INPUT_ATTRIBUTION_TOKENS"
INPUT_ATTRIBUTION_SHARE_ENV = "CDE_INPUT_ATTRIBUTION_SHARE"

# Set by a flag group (cde/commands/worker.py's add_*_arguments) on the parser it joins: which of
# EngineArgs' fields the command's flags give.
ATTENTION_FLAGS, FAIR_SHARE_FLAGS, QUANTIZATION_FLAGS = "_attention_flags", "_fair_share_flags", "_quantization_flags"
PREFIX_CACHE_FLAGS, ASYNC_SCHEDULING_FLAGS = "_prefix_cache_flags", "_async_scheduling_flags"


def engine_args(args: argparse.Namespace, **given: Any) -> EngineArgs:
    """EngineArgs from the flags the command has (--model, --device, --dtype, --max-running and
    each flag group it added) and the environment; `given` are the command's own choices (one
    slot for `cde generate`, a bench's concurrency), which win."""
    fields: dict[str, Any] = {"model": args.model, **_input_attribution_env()}
    fields |= {name: getattr(args, name) for name in ("device", "dtype", "max_running") if hasattr(args, name)}
    if getattr(args, FAIR_SHARE_FLAGS, False):
        fields["max_running_per_client"] = max_running_per_client(args)
    if getattr(args, ATTENTION_FLAGS, False):
        fields |= {"kv_splits": args.kv_splits, "flashblock": flashblock_default(args)}
    if getattr(args, QUANTIZATION_FLAGS, False):
        fields |= {"quantization": quantization(args), "fp8_weight_only_rows": args.fp8_weight_only_rows}
    if getattr(args, PREFIX_CACHE_FLAGS, False):
        fields["prefix_cache"] = not args.no_prefix_cache
    if getattr(args, ASYNC_SCHEDULING_FLAGS, False):
        fields["async_scheduling"] = {"auto": None, "on": True, "off": False}[args.async_scheduling]
    return EngineArgs(**(fields | given))


def worker_settings(args: argparse.Namespace, engine: EngineArgs, served: str | None) -> WorkerSettings:
    """`cde worker`'s flags around its engine; `served`: the name to serve under when
    --served-model-name is not given (a Hub id as given; None: the directory's name)."""
    return WorkerSettings(
        engine=engine,
        bind=args.bind,
        served_model_name=args.served_model_name or served,
        parent_pid=args.parent_pid,
        host_workers=args.host_workers,
        threads=args.threads,
        concept_labels=args.concept_labels,
        model_from_hub=getattr(args, "model_from_hub", False),
        curve_secret_key=args.curve_secret_key,
        curve_authorized_keys=args.curve_authorized_keys,
        gateway_timeout=args.gateway_timeout,
    )


def _input_attribution_env() -> dict[str, Any]:
    tokens, share = os.environ.get(INPUT_ATTRIBUTION_TOKENS_ENV), os.environ.get(INPUT_ATTRIBUTION_SHARE_ENV)
    try:
        out: dict[str, Any] = {"input_attribution_tokens": int(tokens) if tokens else None}
        if share:
            out["input_attribution_share"] = float(share)
    except ValueError:
        raise SystemExit(
            f"{INPUT_ATTRIBUTION_TOKENS_ENV} is an integer and {INPUT_ATTRIBUTION_SHARE_ENV} a number"
        ) from None
    return out


def max_running_per_client(args: argparse.Namespace) -> int:
    from cde.worker.fair_share import default_per_client

    n = args.max_running_per_client
    if n is None:
        return default_per_client(args.max_running)
    if n > args.max_running:
        raise SystemExit(f"--max-running-per-client must be at most --max-running ({args.max_running})")
    return n


def quantization(args: argparse.Namespace) -> str:
    """The --quantization choice, with the flags it needs checked before any model work."""
    if args.fp8_weight_only_rows < 0:
        raise SystemExit("--fp8-weight-only-rows must be >= 0")
    if args.quantization == "fp8" and args.dtype not in ("auto", "bfloat16"):
        raise SystemExit(
            f"--quantization fp8 computes in bfloat16 (its FP8 GEMMs write bfloat16), not {args.dtype}: "
            "use --dtype bfloat16 or --dtype auto"
        )
    return args.quantization


def flashblock_default(args: argparse.Namespace) -> FlashBlockSpec | None:
    """The server's FlashBlock default from the flags (None: exact attention)."""
    if args.flashblock_tau is None:
        return None
    spec = FlashBlockSpec(tau=args.flashblock_tau, max_reuse=args.flashblock_max_reuse)
    try:
        check_flashblock(spec)
    except ValueError:
        raise SystemExit("--flashblock-tau and --flashblock-max-reuse must be >= 0") from None
    return spec
