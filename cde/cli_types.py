"""Argument types of the `cde` flags that take counts, sizes, seconds and ports: a value that
would leave a server up but refusing every request (`--workers -1`, `--max-model-len -5`,
`--heartbeat-timeout 0`) is refused by argparse, naming the flag, before anything starts."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from cde.shared.limits import MAX_KV_SPLITS


def _number(kind: Callable[[str], float], low: float, high: float, what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not low <= value <= high:  # NaN is in no range
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    parse.__name__ = what  # what argparse names in its own messages
    return parse


positive_int = _number(int, 1, math.inf, "a positive integer")
non_negative_int = _number(int, 0, math.inf, "an integer >= 0")
# inf: no limit
positive_seconds = _number(float, math.ulp(0.0), math.inf, "a positive number of seconds")
non_negative_seconds = _number(float, 0.0, math.inf, "a number of seconds >= 0")
port = _number(int, 0, 65535, "a port in [0, 65535]")
kv_splits = _number(int, 0, MAX_KV_SPLITS, f"an integer in [0, {MAX_KV_SPLITS}] (0: chosen per pass)")

ENDPOINT_FORMS = "tcp://HOST:PORT or ipc://PATH"  # the ZeroMQ endpoints of --bind and --worker

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.lower()
