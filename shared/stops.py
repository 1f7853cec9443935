"""Stop strings: one rule, used by the worker (to stop generating) and the gateway (to cut text)."""

from __future__ import annotations


def find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string in `text` as (index, stop), or None."""
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        i = text.find(stop)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best
