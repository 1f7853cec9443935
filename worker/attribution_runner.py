"""Runs a pass's concept attribution off the critical path.

Nothing of the next pass depends on attribution: only the host records do. So on CUDA it runs on
a side stream, replayed as one captured graph per row bucket (the chunked top-k merges are
hundreds of tiny kernels, latency-bound), and its packed rows travel to pinned host memory
there. The engine launches the next forward pass before it reads them: the GPU denoises the
next step while the attribution of the last one finishes, instead of idling while the host
schedules.

The graphs have their own memory pool and their own capture stream (hence their own cuBLAS
workspace): they run concurrently with the forward graphs, which share theirs on the assumption
that they replay one after another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from cde.worker.concept_contributions import attribute, width
from cde.worker.staging import HostCopy

if TYPE_CHECKING:
    from cde.shared.config import ModelConfig
    from cde.worker.model import SteerlingModel

BUCKETS = (8, 32, 128, 512, 2048, 8192)


@dataclass
class _Graph:
    h: torch.Tensor
    tok: torch.Tensor
    target: torch.Tensor
    graph: torch.cuda.CUDAGraph
    out: torch.Tensor


class AttributionRunner:
    def __init__(self, model: SteerlingModel, cfg: ModelConfig, max_rows: int) -> None:
        self.model, self.cfg, self.max_rows = model, cfg, max_rows
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.width = width(cfg)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.graphs: dict[int, _Graph] = {}  # empty: eager (CPU, or CUDA without graphs)
        self._fn = self.pool = None  # set by capture_all (CUDA with graphs)

    def capture_all(self) -> None:
        """CUDA: compile and capture every row bucket a batch of max_rows slots reaches."""
        self._fn = torch.compile(attribute, dynamic=False)
        self.pool = torch.cuda.graph_pool_handle()
        top = next((b for b in BUCKETS if b >= self.max_rows), BUCKETS[-1])
        for size in BUCKETS[: BUCKETS.index(top) + 1]:
            self.graphs[size] = self._capture(size)

    def _capture(self, size: int) -> _Graph:
        h = torch.zeros(size, self.cfg.n_embd, dtype=self.dtype, device=self.device)
        tok = torch.zeros(size, dtype=torch.long, device=self.device)
        target = torch.zeros(size, dtype=self.dtype, device=self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):  # compile and autotune outside the capture
            for _ in range(2):
                self._fn(self.model, self.cfg, h, tok, target)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        # Captured on the runner's own stream, not torch's shared default capture stream: cuBLAS
        # keeps one workspace per (handle, stream) and a captured GEMM keeps its pointer, so graphs
        # captured on one stream share split-K partials and stream-K flags. Replayed beside the
        # forward graphs, two such GEMMs at once gave wrong sums or spun forever (the bf16
        # 32-request stall: GPU 100% busy at idle power, the host waiting on this stream).
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = self._fn(self.model, self.cfg, h, tok, target)
        return _Graph(h, tok, target, graph, out)

    def launch(self, hidden: torch.Tensor, tokens: torch.Tensor, target: torch.Tensor) -> HostCopy:
        """hidden [n, D] final states of committed slots, their tokens [n] and target logits [n],
        computed on the current stream -> the packed rows [n, width], asynchronously."""
        if not self.cuda:
            return HostCopy(attribute(self.model, self.cfg, hidden, tokens, target), None)
        host = torch.empty(hidden.shape[0], self.width, dtype=torch.float64, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in (hidden, tokens, target):
            t.record_stream(self.stream)  # freed by the main stream while the side stream reads
        with torch.cuda.stream(self.stream):
            self.compute(hidden, tokens, target, into=host)
            ready = torch.cuda.Event()
            ready.record()
        return HostCopy(host, ready)

    def compute(self, hidden: torch.Tensor, tokens: torch.Tensor, target: torch.Tensor, into: torch.Tensor) -> None:
        """The packed rows into `into` [n, width] (copies queued, not awaited): replayed through the
        bucket graphs in turns of at most the largest bucket, or eagerly when none were captured."""
        if not self.graphs:
            into.copy_(attribute(self.model, self.cfg, hidden, tokens, target), non_blocking=True)
            return
        n, top = hidden.shape[0], max(self.graphs)
        for start in range(0, n, top):  # more rows than the largest bucket: in turns
            m = min(top, n - start)
            g = self.graphs[next(b for b in BUCKETS if b >= m)]
            # Rows past m keep stale (valid) inputs: computed and never read.
            g.h[:m].copy_(hidden[start : start + m])
            g.tok[:m].copy_(tokens[start : start + m])
            g.target[:m].copy_(target[start : start + m])
            g.graph.replay()
            into[start : start + m].copy_(g.out[:m], non_blocking=True)
