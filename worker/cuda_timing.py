"""Timing GPU work without the host in it: warm-up calls (compiling, autotuning) on a side
stream, one capture as a CUDA graph, then the mean of its replays. The engine replays captured
graphs too, so this is what a kernel costs in a pass; timing eager calls instead adds each call's
launch time (a Triton kernel launched from Python: ~0.1 ms, more than a one-request GEMM)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def graph_replay_ms(fn: Callable[[], T], iters: int = 20, warmup: int = 3) -> tuple[float, T]:
    """Mean ms of one replay of fn() captured as a CUDA graph, and the captured output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture's stream, as torch's docs ask
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters, out
