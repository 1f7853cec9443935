"""The HTTP listener's limits (gateway/http_limits.py) against what real clients do."""

import argparse

import httpx
import openai._constants
from cde.gateway.http_limits import HttpLimits, add_arguments, from_args


def test_idle_connections_outlive_the_clients_own_idle_expiry():
    """A server that closes an idle connection when the client reuses it fails that request with a
    ReadError (CI saw it at 5 s against httpx's 5 s). The client must drop it first."""
    limits = HttpLimits()
    for client_expiry in (
        httpx.Limits().keepalive_expiry,
        openai._constants.DEFAULT_CONNECTION_LIMITS.keepalive_expiry,
    ):
        assert client_expiry is not None and limits.keep_alive_timeout > client_expiry


def test_allowed_origins_are_read_without_their_trailing_slash():
    def origins(*argv: str) -> tuple[str, ...]:
        p = argparse.ArgumentParser()
        p.add_argument("--host", default="127.0.0.1")
        add_arguments(p)
        return from_args(p.parse_args(list(argv))).allowed_origins

    assert origins() == ()
    assert origins("--allowed-origins", "https://a.example/, http://b.example:8080,") == (
        "https://a.example",
        "http://b.example:8080",
    )
    assert origins("--allowed-origins", "https://a.example,*") == ("*",)
