"""How long and how many: the HTTP listener's timeouts, its connection cap, the Host names it
answers and the web origins whose pages may call it, as `cde serve` and `cde gateway` flags. All
of them apply before the API key is checked, so an unauthenticated client can hold neither a
connection nor a request open for long."""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class HttpLimits:
    header_timeout: float = 10.0  # a request's line and headers, from its first byte (or the connection's start)
    body_timeout: float = 30.0  # the whole body, from the end of the headers
    # An idle connection between requests. Longer than the clients' own idle expiry (httpx's, so
    # the openai SDK's, is 5 s; aiohttp's 15 s): the client drops an idle connection first, and
    # never sends a request on one the server is closing at that moment (a ReadError).
    keep_alive_timeout: float = 20.0
    max_connections: int = 1024  # open at once; the next ones get 503
    allowed_hosts: frozenset[str] | None = None  # Host header names; None: any
    max_connections_per_client: int | None = None  # from one address; None: 3/4 of max_connections
    # Web origins whose pages may call the API (CORS); none by default, so that no page a user
    # visits can spend a local server's compute; ("*",): any, as vLLM's default.
    allowed_origins: tuple[str, ...] = ()

    @property
    def per_client_connections(self) -> int:
        """One address may hold 3/4 of the connections by default: the rest stay for the others."""
        if self.max_connections_per_client is not None:
            return self.max_connections_per_client
        return max(1, self.max_connections * 3 // 4)

    def host_allowed(self, host: str) -> bool:
        """`host`: the Host header without its port, lower case."""
        return self.allowed_hosts is None or host in self.allowed_hosts


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = HttpLimits()
    p.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout,
        help="seconds a client has to send a request's headers",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout,
        help="seconds a client has to send a request's whole body; later: 408",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=d.keep_alive_timeout,
        help="seconds an idle keep-alive connection stays open",
    )
    p.add_argument(
        "--max-connections", type=int, default=d.max_connections, help="open HTTP connections at once; more get 503"
    )
    p.add_argument(
        "--max-connections-per-client",
        type=int,
        metavar="N",
        help="open HTTP connections from one address; more get 503 (default: 3/4 of --max-connections)",
    )
    p.add_argument(
        "--allowed-hosts",
        metavar="NAMES",
        help="comma-separated Host header names to answer, `*` for any (default: loopback names "
        "when --host is a loopback address, against DNS rebinding; any otherwise)",
    )
    p.add_argument(
        "--allowed-origins",
        metavar="ORIGINS",
        help="comma-separated web origins (e.g. https://app.example.com) whose pages may call the API "
        "from a browser (CORS), `*` for any (default: none)",
    )


def from_args(args: argparse.Namespace) -> HttpLimits:
    if args.allowed_hosts is not None:
        names = {n.strip().lower().rstrip(".") for n in args.allowed_hosts.split(",") if n.strip()}
        hosts = None if "*" in names else frozenset(names)
    else:
        hosts = LOOPBACK_NAMES | {args.host.lower()} if is_loopback(args.host) else None
    for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "max_connections"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    per_client = args.max_connections_per_client
    if per_client is not None and not 1 <= per_client <= args.max_connections:
        raise SystemExit("--max-connections-per-client must be in [1, --max-connections]")
    origins = tuple(o.strip().rstrip("/") for o in (args.allowed_origins or "").split(",") if o.strip())
    return HttpLimits(
        args.header_timeout,
        args.body_timeout,
        args.keep_alive_timeout,
        args.max_connections,
        hosts,
        per_client,
        ("*",) if "*" in origins else origins,
    )
