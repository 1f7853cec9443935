"""Run one engine worker process that serves a gateway over ZeroMQ (for multi-machine setups;
`cde serve` starts its workers itself)."""

from __future__ import annotations

import os
import sys

from shared.logs import setup_logging


def add_arguments(p) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the built-in demo model)")
    p.add_argument("--bind", default="tcp://127.0.0.1:5555", help="ZeroMQ endpoint to listen on (tcp://HOST:PORT or ipc://PATH)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    p.add_argument("--max-running", type=int, default=16, help="requests decoded concurrently")
    p.add_argument("--served-model-name", help="model name reported to the gateway (default: the checkpoint directory's name)")
    p.add_argument("--parent-pid", type=int, help="exit when this process is no longer our parent (used by `cde serve`)")


def run(args) -> int:
    from worker.checkpoint import demo_model_dir
    from worker.engine import Engine, EngineArgs
    from worker.server import run_worker

    setup_logging("worker", os.environ.get("CDE_LOG_LEVEL", "INFO"))
    engine = Engine(EngineArgs(args.model or str(demo_model_dir()), device=args.device, dtype=args.dtype, max_running=args.max_running))
    run_worker(engine, args.bind, args.served_model_name, args.parent_pid)
    # Sockets are closed and results sent; tearing down the torch interpreter would only add
    # more than a second to every shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
