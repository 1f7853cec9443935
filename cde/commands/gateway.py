"""Run the OpenAI-compatible HTTP gateway in front of already running workers (`cde worker`)."""

from __future__ import annotations

import argparse
import socket
import subprocess
from typing import TYPE_CHECKING, Any

from cde.cli_types import (
    ENDPOINT_FORMS,
    LOG_LEVELS,
    log_level,
    non_negative_int,
    non_negative_seconds,
    port,
    positive_int,
    positive_seconds,
)
from cde.commands.api_key_args import add_api_key_arguments, api_key
from cde.commands.model_args import MODEL_HELP, add_model_arguments, resolve_model_args
from cde.gateway.http_limits import add_arguments as add_limit_arguments
from cde.shared.logs import setup_logging

if TYPE_CHECKING:
    from cde.gateway.concepts import ConceptLabels
    from cde.gateway.state import ServerState


def add_http_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared with `cde serve`."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every IPv4 interface)")
    p.add_argument("--port", type=port, default=8000, help="0 picks a free port")
    p.add_argument("--served-model-name", help="model name clients use (default: reported by the workers)")
    add_api_key_arguments(p, "require `Authorization: Bearer KEY`")
    p.add_argument(
        "--max-queue",
        type=non_negative_int,
        default=256,
        help="requests queued per worker beyond max-running before 429",
    )
    p.add_argument(
        "--max-queued-per-client",
        type=positive_int,
        default=128,
        help="requests (choices) one client (API key or address) may have in flight before 429",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=positive_seconds,
        default=5.0,
        help="seconds without a heartbeat before a worker counts as dead",
    )
    p.add_argument(
        "--engine-stall-timeout",
        type=positive_seconds,
        default=60.0,
        help="seconds a worker's engine may go without progress (one forward pass, on a hung device: "
        "forever) while its I/O thread still answers, before its requests fail and it counts as down "
        "until it moves again; raise it above the longest pass (a large model on the CPU)",
    )
    p.add_argument(
        "--routing",
        default="prefix",
        choices=["prefix", "least-loaded", "round-robin"],
        help="prefix: a prompt goes to the worker that holds its first page in its prefix cache, unless that "
        "worker has a whole batch more requests than the least loaded; least-loaded: fewest outstanding "
        "requests; round-robin: in turn (default: %(default)s)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=non_negative_seconds,
        default=30.0,
        help="seconds in-flight requests get to finish on shutdown",
    )
    p.add_argument(
        "--concept-labels",
        metavar="PATH",
        help="concept catalog, concept_labels.parquet or a labels CSV (default: $STEERLING_CONCEPTS_PATH, "
        "then concept_labels.* in the model directory, then guidelabs/steerling's in the Hub cache)",
    )
    p.add_argument(
        "--max-request-bytes", type=positive_int, default=4 << 20, help="larger request bodies get 413 (default 4 MiB)"
    )
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        help="cap on prompt + generated tokens per request (default: the model's context)",
    )
    p.add_argument(
        "--log-level", type=log_level, default="info", help=f"{' | '.join(LOG_LEVELS)} (JSON lines on stderr)"
    )
    p.add_argument(
        "--log-requests", action="store_true", help="also log prompts and generated text (default: off, never logged)"
    )
    add_limit_arguments(p)


def check_port(host: str, port: int, command: str) -> None:
    """Exit in one line if the port cannot be listened on: checked before any worker or model
    work (an 8B load takes minutes), where uvicorn would find out only when ready to serve."""
    if port == 0:
        return
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind((host, port))
    except OSError as exc:  # gaierror included: a host that does not resolve
        raise SystemExit(f"cde {command}: cannot listen on {host}:{port} ({exc.strerror or exc})") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cde.gateway.discovery import dns_target

    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="worker endpoint, e.g. tcp://10.0.0.2:5555 (repeatable)",
    )
    p.add_argument(
        "--worker-dns",
        action="append",
        default=[],
        type=dns_target,
        metavar="NAME:PORT",
        help="connect to every IPv4 address NAME resolves to, re-resolved every --dns-interval "
        "seconds (a Kubernetes headless Service; repeatable)",
    )
    p.add_argument("--dns-interval", type=float, default=5.0, help="seconds between --worker-dns resolutions")
    p.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="this gateway's CURVE key pair (NAME.key_secret): "
        "encrypt and authenticate the worker links; needs --curve-server-key (default: none, plain links)",
    )
    p.add_argument("--curve-server-key", metavar="FILE", help="the workers' CURVE public key (NAME.key; default: none)")
    add_model_arguments(
        p, MODEL_HELP + ", only read for its concept labels (default: none; the workers send their catalogs)"
    )
    p.add_argument(
        "--wait",
        type=float,
        help="wait up to this many seconds for every worker before serving (default: serve at once)",
    )
    add_http_arguments(p)


def check_worker_endpoints(endpoints: list[str]) -> None:
    """Each connected once, as the router will: zmq refuses a malformed one only then, inside the
    server's startup, where it would end the command in a logged ZMQError."""
    import zmq

    ctx = zmq.Context()
    try:
        for endpoint in endpoints:
            sock = ctx.socket(zmq.DEALER)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:
                raise SystemExit(
                    f"cde gateway: --worker {endpoint}: {zmq.strerror(exc.errno or 0)} "
                    f"(an endpoint is {ENDPOINT_FORMS})"
                ) from None
            finally:
                sock.close(linger=0)
    finally:
        ctx.term()


def concept_labels(args: argparse.Namespace, model_dir: str | None) -> ConceptLabels:
    """The concept labels a server (or `cde generate`) names concepts by."""
    from cde.gateway.concepts import ConceptLabels
    from cde.shared.catalog import CatalogError

    try:
        return ConceptLabels.load(model_dir, args.concept_labels, fetch=getattr(args, "model_from_hub", False))
    except CatalogError as exc:
        raise SystemExit(f"cde: {exc}") from None


def build_state(
    args: argparse.Namespace,
    endpoints: list[str],
    processes: list[subprocess.Popen] | None = None,
    model_dir: str | None = None,
    model_root: str | None = None,
    **router_options: Any,
) -> ServerState:
    from cde.gateway.router import Router
    from cde.gateway.state import ServerState

    labels = concept_labels(args, model_dir)
    router = Router(
        endpoints,
        processes,
        heartbeat_timeout=args.heartbeat_timeout,
        engine_stall_timeout=args.engine_stall_timeout,
        max_queue=args.max_queue,
        max_queued_per_client=args.max_queued_per_client,
        routing=args.routing,
        fetch_catalogs=not len(labels.catalog),  # the workers' catalogs, for a gateway without one
        **router_options,
    )
    return ServerState(
        router,
        args.served_model_name,
        api_key(args),
        labels,
        max_model_len=args.max_model_len,
        log_requests=args.log_requests,
        model_root=model_root or model_dir,
    )


def run(args: argparse.Namespace) -> int:
    from cde.gateway.app import create_app
    from cde.gateway.discovery import DnsDiscovery
    from cde.gateway.http_limits import from_args as limits_from_args
    from cde.gateway.http_server import serve_http
    from cde.shared.curve import CurveClient, CurveKeyError

    if not args.worker and not args.worker_dns:
        raise SystemExit("cde gateway: give at least one --worker ENDPOINT or --worker-dns NAME:PORT")
    check_worker_endpoints(args.worker)
    if bool(args.curve_secret_key) != bool(args.curve_server_key):
        raise SystemExit("cde gateway: --curve-secret-key and --curve-server-key go together")
    try:
        curve = CurveClient.from_files(args.curve_secret_key, args.curve_server_key) if args.curve_secret_key else None
    except CurveKeyError as exc:
        raise SystemExit(f"cde gateway: {exc}") from None
    discovery = DnsDiscovery(args.worker_dns, args.dns_interval) if args.worker_dns else None
    resolve_model_args(args, "gateway", demo=False)
    check_port(args.host, args.port, "gateway")
    setup_logging("gateway", args.log_level)
    state = build_state(args, args.worker, model_dir=args.model, curve=curve, discovery=discovery)
    app = create_app(
        state, wait_for_workers=args.wait, max_request_bytes=args.max_request_bytes, limits=limits_from_args(args)
    )
    return serve_http(
        app,
        args.host,
        args.port,
        banner="CDE gateway listening on {url}/v1",
        shutdown_timeout=args.shutdown_timeout,
        log_level=args.log_level,
    )
