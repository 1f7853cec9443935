"""Run one engine worker process that serves a gateway over ZeroMQ (for multi-machine setups;
`cde serve` starts its workers itself)."""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import errno
import logging
import os
import re
import signal
import sys
import time
from typing import TYPE_CHECKING

from cde.cli_types import ENDPOINT_FORMS, kv_splits, positive_int, positive_seconds
from cde.commands.model_args import add_model_arguments, resolve_model_args
from cde.commands.settings_builder import (
    ASYNC_SCHEDULING_FLAGS,
    ATTENTION_FLAGS,
    FAIR_SHARE_FLAGS,
    PREFIX_CACHE_FLAGS,
    QUANTIZATION_FLAGS,
    engine_args,
    worker_settings,
)
from cde.shared.config import FP8_WEIGHT_ONLY_ROWS
from cde.shared.logs import setup_logging
from cde.shared.protocol import FlashBlockSpec
from cde.shared.settings import GATEWAY_TIMEOUT_S, WorkerSettings

if TYPE_CHECKING:
    from cde.shared.catalog_file import CatalogFile
    from cde.shared.curve import CurveServer
    from cde.worker.worker_io import Listener

DEVICE_HELP = "auto: cuda when a GPU is visible, else cpu"
DEVICES = ("auto", "cpu", "cuda")  # a worker also takes cuda:N
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
DTYPES = ("auto", "float32", "bfloat16")  # what the engine computes in
DTYPE_HELP = "weights and activations; auto: bfloat16 on cuda, float32 on cpu"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--bind", default="tcp://127.0.0.1:5555", help=f"ZeroMQ endpoint to listen on ({ENDPOINT_FORMS})")
    p.add_argument("--device", type=worker_device, default="auto", help="auto | cpu | cuda | cuda:N; " + DEVICE_HELP)
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--max-running", type=positive_int, default=16, help="requests decoded concurrently")
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
        "--gateway-timeout",
        type=positive_seconds,
        default=GATEWAY_TIMEOUT_S,
        help="seconds a gateway may send nothing (a gateway Pings twice a second) before the requests it sent "
        "here are dropped: one that crashed or restarted is waited for by no client",
    )
    p.add_argument(
        "--concept-labels",
        metavar="PATH",
        help="concept catalog sent to the gateways that connect (default: as `cde serve` finds it: "
        "$STEERLING_CONCEPTS_PATH, concept_labels.* in the model directory, the Hub cache)",
    )
    # `cde serve` passes every setting of a worker it starts as one message (shared/settings.py).
    p.add_argument("--settings-json", help=argparse.SUPPRESS)
    p.add_argument(
        "--parent-pid",
        type=int,
        help="exit when this process, our parent, ends (the kernel's PR_SET_PDEATHSIG, which fires when the "
        "thread that started us ends: start the worker from one that lives as long as the process; default: none)",
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
    add_async_scheduling_arguments(p)


def worker_device(text: str) -> str:
    """Checked here: torch would refuse `gpu` only once the weights load, listing its 20 device types."""
    if text in DEVICES or re.fullmatch(r"cuda:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")


def add_async_scheduling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--async-scheduling",
        default="auto",
        choices=["auto", "on", "off"],
        help="plan each forward pass before the last one's picks reach the host, so the GPU never waits "
        "for the scheduler (worker/plan_ahead.py); the same tokens. auto: on with CUDA, off on the CPU (where a "
        "pass planned ahead only delays each result by a pass)",
    )
    p.set_defaults(**{ASYNC_SCHEDULING_FLAGS: True})


def add_prefix_cache_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="prefill every prompt in full: no K/V pages of full 64-token prompt blocks shared between "
        "requests, no usage.prompt_tokens_details.cached_tokens (default: the prefix cache is on)",
    )
    p.set_defaults(**{PREFIX_CACHE_FLAGS: True})


def add_fair_share_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-running-per-client",
        type=positive_int,  # at most --max-running: checked with it, in settings_builder
        metavar="N",
        help="slots one client (API key or address) may hold, so that others find one free "
        "(default: 3/4 of --max-running); admission is round-robin over clients",
    )
    p.set_defaults(**{FAIR_SHARE_FLAGS: True})


def add_thread_arguments(p: argparse.ArgumentParser, workers: bool = True) -> None:
    p.add_argument(
        "--threads",
        type=positive_int,
        metavar="N",
        help="CPU: torch's intra-op threads (default: $OMP_NUM_THREADS if set, else this host's usable cores "
        + ("divided among its workers, " if workers else "")
        + "at most the cores its load leaves idle)",
    )


def add_attention_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-splits",
        type=kv_splits,
        default=0,
        metavar="S",
        help="CUDA: split each item's cached pages S ways at batch 1 (S/2 at 2, ...) for more parallel "
        "attention at small batches, at any context; exact. By default (0) chosen per pass (8 ways at batch 1 "
        "and 4 at batch 2 from a 2,048-token context, none otherwise)",
    )
    p.add_argument(
        "--flashblock-tau",
        type=int,  # its range is checked in settings_builder, with --flashblock-max-reuse's
        metavar="N",
        help=(
            "FlashBlock by default: reuse the cached-page attention unless the last step unmasked >= N tokens "
            "(default: off, exact)"
        ),
    )
    p.add_argument(
        "--flashblock-max-reuse",
        type=int,
        default=FlashBlockSpec.max_reuse,
        help="FlashBlock: recompute after M reuses in a row",
    )
    p.set_defaults(**{ATTENTION_FLAGS: True})


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
        help="fp8: passes of at most N rows (64 per item) keep their activations in bfloat16 (weight-only: more "
        "accurate, slower); larger ones quantize the activations per token for FP8 GEMMs (default: %(default)s, "
        "FP8 GEMMs at every size)",
    )
    p.set_defaults(**{QUANTIZATION_FLAGS: True})


def check_quantization_device(quantization: str, device: str) -> None:
    """Refuses --quantization fp8 on a device that cannot run it (a GPU without FP8 tensor cores,
    an accelerator other than CUDA) before the weights load. Imports torch."""
    if quantization == "none":
        return
    import torch

    from cde.worker.fp8 import check_quantization

    try:
        check_quantization(quantization, device, torch.bfloat16)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def catalog_file(settings: WorkerSettings) -> CatalogFile | None:
    """The concept catalog this worker sends to its gateways, found as a gateway finds its own."""
    from cde.shared.catalog import find_catalog
    from cde.shared.catalog_file import CatalogFile

    path = find_catalog(settings.concept_labels, settings.engine.model, settings.model_from_hub)
    if path is None:
        return None
    catalog = CatalogFile.read(path)
    logging.getLogger("cde.worker").info("concept catalog %s (sha256 %s)", path, catalog.digest[:12])
    return catalog


def curve_server(secret_key: str | None, authorized_keys: str | None) -> CurveServer | None:
    from cde.shared.curve import CurveKeyError, CurveServer

    if bool(secret_key) != bool(authorized_keys):
        raise SystemExit("cde worker: --curve-secret-key and --curve-authorized-keys go together")
    if not secret_key or not authorized_keys:
        return None
    try:
        return CurveServer.from_files(secret_key, authorized_keys)
    except CurveKeyError as exc:
        raise SystemExit(f"cde worker: {exc}") from None


def die_with_parent(parent_pid: int | None) -> None:
    """SIGTERM from the kernel when the process that started us ends, at any moment: while the
    model loads too (minutes at 8B, holding the GPU), when no loop of ours is there to notice."""
    if parent_pid is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # it ended before the prctl: no signal will come
        raise SystemExit(f"cde worker: process {parent_pid} is not (or no longer) this worker's parent")


def listen(bind: str, curve: CurveServer | None) -> Listener:
    """The worker's socket, bound; or one line naming what is wrong with the endpoint. Tried once
    before the model loads or downloads (a busy port or a malformed endpoint fails at once), then
    bound for good once the engine is ready: an open port says the worker is loaded, which the
    deployments' TCP probes read (deploy/k8s/worker-statefulset.yaml)."""
    import zmq

    from cde.worker.worker_io import Listener

    try:
        return Listener(bind, curve)
    except zmq.ZMQError as exc:
        what = zmq.strerror(exc.errno or 0)
        if exc.errno not in (errno.EADDRINUSE, errno.EACCES):  # else the endpoint itself is wrong
            what += f" (an endpoint is {ENDPOINT_FORMS})"
        raise SystemExit(f"cde worker: cannot listen on --bind {bind}: {what}") from None


def run(args: argparse.Namespace) -> int:
    from cde.cli import STARTED

    # Keys, endpoint and flags before the model resolves: a bad one should not take minutes to report.
    if args.settings_json is not None:  # from the `cde serve` that started this process
        try:
            settings = WorkerSettings.from_json(args.settings_json)
        except ValueError as exc:
            raise SystemExit(f"cde worker: --settings-json: {exc}") from None
        die_with_parent(settings.parent_pid)
        curve = curve_server(settings.curve_secret_key, settings.curve_authorized_keys)
        listen(settings.bind, None).close()
    else:
        die_with_parent(args.parent_pid)
        curve = curve_server(args.curve_secret_key, args.curve_authorized_keys)
        given = engine_args(args)
        listen(args.bind, None).close()
        served = resolve_model_args(args, "worker")  # the model as a local directory
        settings = worker_settings(args, dataclasses.replace(given, model=args.model), served)
    from cde.worker.devices import resolve_device
    from cde.worker.engine import Engine
    from cde.worker.zmq_server import run_worker

    device = resolve_device(settings.engine.device)
    check_quantization_device(settings.engine.quantization, device)
    setup_logging("worker", os.environ.get("CDE_LOG_LEVEL", "INFO"))
    catalog = catalog_file(settings)  # a bad path fails before the weights load
    if device == "cpu":
        from cde.worker.cpu_threads import set_cpu_threads

        set_cpu_threads(settings.threads, settings.host_workers)
    engine = Engine(settings.engine)
    # From the process's start: imports, weights, compilation and graph capture.
    ready_s = time.monotonic() - STARTED
    logging.getLogger("cde.worker").info("ready in %.1f s", ready_s, extra={"ready_s": round(ready_s, 3)})
    run_worker(engine, listen(settings.bind, curve), settings.served_model_name, catalog, settings.gateway_timeout)
    # Sockets are closed and results sent; tearing down the torch interpreter would only add
    # more than a second to every shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
