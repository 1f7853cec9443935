"""Run one engine worker process that serves a gateway over ZeroMQ (for multi-machine setups;
`cde serve` starts its workers itself)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import TYPE_CHECKING

from cde.commands.model_args import add_model_arguments, resolve_model_args
from cde.shared.config import FP8_WEIGHT_ONLY_ROWS
from cde.shared.logs import setup_logging

if TYPE_CHECKING:
    from cde.shared.catalog_file import CatalogFile
    from cde.shared.protocol import FlashBlockSpec

DEVICE_HELP = "auto: cuda when a GPU is visible, else cpu"
DTYPE_HELP = "weights and activations; auto: bfloat16 on cuda, float32 on cpu"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument(
        "--bind", default="tcp://127.0.0.1:5555", help="ZeroMQ endpoint to listen on (tcp://HOST:PORT or ipc://PATH)"
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N; " + DEVICE_HELP)
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16; " + DTYPE_HELP)
    p.add_argument("--max-running", type=int, default=16, help="requests decoded concurrently")
    add_fair_share_arguments(p)
    p.add_argument(
        "--served-model-name",
        help="model name reported to the gateway (default: the Hub id as given, or the directory's name)",
    )
    p.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="this worker's CURVE key pair (NAME.key_secret): encrypt the link and admit only "
        "--curve-authorized-keys (default: none, a plain link)",
    )
    p.add_argument(
        "--curve-authorized-keys",
        metavar="FILE|DIR",
        help="public keys (NAME.key) of the gateways allowed to connect: one file, or every *.key in DIR "
        "(default: none)",
    )
    p.add_argument(
        "--concept-labels",
        metavar="PATH",
        help="concept catalog sent to the gateways that connect (default: as `cde serve` finds it: "
        "$STEERLING_CONCEPTS_PATH, concept_labels.* in the model directory, the Hub cache)",
    )
    p.add_argument(
        "--parent-pid",
        type=int,
        help="exit when this process is no longer our parent (used by `cde serve`; default: none)",
    )
    p.add_argument(
        "--host-workers",
        type=int,
        default=1,
        metavar="K",
        help="CPU: worker processes sharing this host's cores (`cde serve` passes its --workers)",
    )
    add_thread_arguments(p)
    add_attention_arguments(p)
    add_quantization_arguments(p)
    add_prefix_cache_arguments(p)


def add_prefix_cache_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="prefill every prompt in full: no K/V pages of full 64-token prompt blocks shared between "
        "requests, no usage.prompt_tokens_details.cached_tokens (default: the prefix cache is on)",
    )


def prefix_cache_flags(args: argparse.Namespace) -> list[str]:
    """The same flag again, for a worker process `cde serve` starts."""
    return ["--no-prefix-cache"] if args.no_prefix_cache else []


def add_fair_share_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-running-per-client",
        type=int,
        metavar="N",
        help="slots one client (API key or address) may hold, so that others find one free "
        "(default: 3/4 of --max-running); admission is round-robin over clients",
    )


def max_running_per_client(args: argparse.Namespace) -> int:
    from cde.worker.fair_share import default_per_client

    n = args.max_running_per_client
    if n is None:
        return default_per_client(args.max_running)
    if not 1 <= n <= args.max_running:
        raise SystemExit(f"--max-running-per-client must be in [1, --max-running ({args.max_running})]")
    return n


def add_thread_arguments(p: argparse.ArgumentParser, workers: bool = True) -> None:
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="CPU: torch's intra-op threads (default: $OMP_NUM_THREADS if set, else this host's usable cores "
        + ("divided among its workers, " if workers else "")
        + "at most the cores its load leaves idle)",
    )


def add_attention_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-splits",
        type=int,
        default=1,
        metavar="S",
        help="CUDA: split each item's cached pages S ways at batch 1 (S/2 at 2, ...) for more parallel "
        "attention at small batches; exact (default: 1, off)",
    )
    p.add_argument(
        "--flashblock-tau",
        type=int,
        help=(
            "FlashBlock by default: reuse the cached-page attention unless the last step unmasked >= N tokens "
            "(default: off, exact)"
        ),
    )
    p.add_argument("--flashblock-max-reuse", type=int, default=16, help="FlashBlock: recompute after M reuses in a row")


def add_quantization_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quantization",
        default="none",
        choices=["none", "fp8"],
        help="fp8: the transformer's linear layers in float8 e4m3 with per-output-channel scales, quantized at "
        "load from the bfloat16 checkpoint (embeddings, LM head and concept heads stay bfloat16); needs a GPU "
        "with FP8 tensor cores (compute capability 8.9+), emulated on the CPU; --dtype auto is then bfloat16 "
        "on the CPU too (default: none)",
    )
    p.add_argument(
        "--fp8-weight-only-rows",
        type=int,
        default=FP8_WEIGHT_ONLY_ROWS,
        metavar="N",
        help="fp8: passes of at most N rows (64 per item) dequantize the weights to bfloat16 in the graph; "
        "larger ones quantize the activations per token for FP8 GEMMs (default: %(default)s, FP8 GEMMs at every size)",
    )


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


def check_quantization_device(args: argparse.Namespace, device: str) -> None:
    """Refuses --quantization fp8 on a device that cannot run it (a GPU without FP8 tensor cores,
    an accelerator other than CUDA) before the weights load. Imports torch."""
    if quantization(args) == "none":
        return
    import torch

    from cde.worker.fp8 import check_quantization

    try:
        check_quantization(args.quantization, device, torch.bfloat16)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def quantization_flags(args: argparse.Namespace) -> list[str]:
    """The same flags again, for a worker process `cde serve` starts."""
    return ["--quantization", quantization(args), "--fp8-weight-only-rows", str(args.fp8_weight_only_rows)]


def flashblock_default(args: argparse.Namespace) -> FlashBlockSpec | None:
    """The server's FlashBlock default from the flags (None: exact attention)."""
    from cde.shared.limits import check_flashblock
    from cde.shared.protocol import FlashBlockSpec

    if args.flashblock_tau is None:
        return None
    spec = FlashBlockSpec(tau=args.flashblock_tau, max_reuse=args.flashblock_max_reuse)
    try:
        check_flashblock(spec)
    except ValueError:
        raise SystemExit("--flashblock-tau and --flashblock-max-reuse must be >= 0") from None
    return spec


MAX_KV_SPLITS = 64  # a 4096-token context is 64 pages: more shares than pages would stay empty


def kv_splits(args: argparse.Namespace) -> int:
    if not 1 <= args.kv_splits <= MAX_KV_SPLITS:
        raise SystemExit(f"--kv-splits must be in [1, {MAX_KV_SPLITS}]")
    return args.kv_splits


def attention_flags(args: argparse.Namespace) -> list[str]:
    """The same flags again, for a worker process `cde serve` starts."""
    flags = ["--kv-splits", str(kv_splits(args))]
    if args.flashblock_tau is None:
        return flags
    return flags + [
        "--flashblock-tau",
        str(args.flashblock_tau),
        "--flashblock-max-reuse",
        str(args.flashblock_max_reuse),
    ]


def catalog_file(args: argparse.Namespace) -> CatalogFile | None:
    """The concept catalog this worker sends to its gateways, found as a gateway finds its own."""
    from cde.shared.catalog import find_catalog
    from cde.shared.catalog_file import CatalogFile

    path = find_catalog(args.concept_labels, args.model, getattr(args, "model_from_hub", False))
    if path is None:
        return None
    catalog = CatalogFile.read(path)
    logging.getLogger("cde.worker").info("concept catalog %s (sha256 %s)", path, catalog.digest[:12])
    return catalog


def run(args: argparse.Namespace) -> int:
    from cde.cli import STARTED
    from cde.shared.curve import CurveKeyError, CurveServer
    from cde.worker.engine import Engine, EngineArgs
    from cde.worker.server import run_worker

    if bool(args.curve_secret_key) != bool(args.curve_authorized_keys):
        raise SystemExit("cde worker: --curve-secret-key and --curve-authorized-keys go together")
    try:  # before loading the model: a bad key path should not take minutes to report
        curve = (
            CurveServer.from_files(args.curve_secret_key, args.curve_authorized_keys) if args.curve_secret_key else None
        )
    except CurveKeyError as exc:
        raise SystemExit(f"cde worker: {exc}") from None
    splits, flashblock = kv_splits(args), flashblock_default(args)  # bad flags fail before any model work
    per_client = max_running_per_client(args)
    quantization(args)
    setup_logging("worker", os.environ.get("CDE_LOG_LEVEL", "INFO"))
    served = resolve_model_args(args, "worker")
    catalog = catalog_file(args)  # a bad path fails before the weights load
    from cde.worker.engine import resolve_device

    device = resolve_device(args.device)
    check_quantization_device(args, device)
    if device == "cpu":
        from cde.worker.cpu_threads import set_cpu_threads

        set_cpu_threads(args.threads, args.host_workers)
    engine = Engine(
        EngineArgs(
            args.model,
            device=args.device,
            dtype=args.dtype,
            max_running=args.max_running,
            max_running_per_client=per_client,
            flashblock=flashblock,
            kv_splits=splits,
            quantization=args.quantization,
            fp8_weight_only_rows=args.fp8_weight_only_rows,
            prefix_cache=not args.no_prefix_cache,
        )
    )
    # From the process's start: imports, weights, compilation and graph capture.
    ready_s = time.monotonic() - STARTED
    logging.getLogger("cde.worker").info("ready in %.1f s", ready_s, extra={"ready_s": round(ready_s, 3)})
    run_worker(engine, args.bind, args.served_model_name or served, args.parent_pid, curve, catalog)
    # Sockets are closed and results sent; tearing down the torch interpreter would only add
    # more than a second to every shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
