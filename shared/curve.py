"""ZeroMQ CURVE for gateway <-> worker links that leave the machine: encryption plus key-based
access control. Keys are ZeroMQ certificate files (`cde keys generate`): `NAME.key` holds the
public key, `NAME.key_secret` both keys.

The worker is the CURVE server: it knows its own secret key and the public keys of the gateways it
serves (a ZAP authenticator rejects all others during the handshake). A gateway is a CURVE client:
it knows its own key pair and the worker's public key. Nothing here is used unless keys are given.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("cde.curve")


class CurveKeyError(ValueError):
    """A key file that is missing, unreadable or of the wrong kind."""


def generate(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Writes NAME.key (public, to hand out) and NAME.key_secret (owner-only). Returns both paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = (Path(p) for p in zmq.auth.create_certificates(directory, name))
    secret.chmod(0o600)
    return public, secret


def _load(path: str | os.PathLike, want_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read CURVE key {path}: {exc}") from None
    if want_secret and secret is None:
        raise CurveKeyError(f"{path} holds no secret key (pass the .key_secret file)")
    return public, secret


def authorized_keys(path: str | os.PathLike) -> set[bytes]:
    """Public keys (z85) from one key file or every *.key file of a directory."""
    path = Path(path)
    files = sorted(path.glob("*.key")) if path.is_dir() else [path]
    keys = {_load(f, want_secret=False)[0] for f in files}
    if not keys:
        raise CurveKeyError(f"no public keys (*.key) in {path}")
    return keys


@dataclass(frozen=True)
class CurveServer:
    """The worker side: its key pair and the client keys it admits."""

    public: bytes
    secret: bytes
    allowed: frozenset[bytes]

    @classmethod
    def from_files(cls, secret_key_file: str | os.PathLike, authorized: str | os.PathLike) -> CurveServer:
        public, secret = _load(secret_key_file, want_secret=True)
        return cls(public, secret, frozenset(authorized_keys(authorized)))

    def secure(self, ctx: zmq.Context, sock: zmq.Socket) -> ThreadAuthenticator:
        """Call before `bind`. The returned authenticator must be stopped before `ctx.term()`."""
        auth = ThreadAuthenticator(ctx, log=logging.getLogger("cde.curve.zap"))
        auth.start()
        auth.configure_curve_callback("*", credentials_provider=_Admission(self.allowed))
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = self.secret, self.public, True
        return auth


class _Admission:
    """ZAP callback: admits the authorized keys; names each rejected key once (clients retry the
    handshake every reconnect interval, so logging every attempt would flood the log)."""

    def __init__(self, allowed: frozenset[bytes]):
        self.allowed, self.rejected = allowed, set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        if key not in self.rejected:
            self.rejected.add(key)
            log.warning("rejected a gateway with CURVE public key %s: not in --curve-authorized-keys", key.decode())
        return False


@dataclass(frozen=True)
class CurveClient:
    """The gateway side: its key pair and the workers' public key."""

    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def from_files(cls, secret_key_file: str | os.PathLike, server_key_file: str | os.PathLike) -> CurveClient:
        public, secret = _load(secret_key_file, want_secret=True)
        return cls(public, secret, _load(server_key_file, want_secret=False)[0])

    def secure(self, sock: zmq.Socket) -> None:
        """Call before `connect`."""
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = self.secret, self.public, self.server_public

    async def watch(self, sock: zmq.Socket, name: str, on_failure: Callable[[str], None]) -> None:
        """Reports failed handshakes (wrong worker key, or this gateway not authorized): without
        this, a refused link looks the same as a worker that is not up yet."""
        monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | functools.reduce(operator.or_, _HANDSHAKE_ERRORS)
        )
        failed = False
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    failed = False
                elif not failed:
                    failed = True
                    log.error("%s: %s", name, _HANDSHAKE_ERRORS[event["event"]])
                    on_failure(_HANDSHAKE_ERRORS[event["event"]])
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)


_HANDSHAKE_ERRORS = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "CURVE handshake refused by the worker: this gateway's public key "
    "is not in the worker's --curve-authorized-keys",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "CURVE handshake dropped by the worker: --curve-server-key is "
    "not this worker's public key",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "CURVE handshake failed: the worker does not use CURVE "
    "(start it with --curve-secret-key)",
}
