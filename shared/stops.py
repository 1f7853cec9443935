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


def first_stop_end(text: str, stops: list[str]) -> int | None:
    """Where the first stop string to be complete in `text` ends (vLLM's include_stop_str_in_output
    keeps the text up to there), or None. Text that grows adds no occurrence that ends earlier, so
    however it arrives, this is where the worker stopped."""
    ends = [i + len(stop) for stop in stops if stop and (i := text.find(stop)) >= 0]
    return min(ends, default=None)
