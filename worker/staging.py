"""Host <-> device transfers that never wait for the GPU when they are queued.

A plain `torch.tensor(list, device="cuda")` is a synchronous copy: the host stalls until every
kernel already queued has run, so the host work of a step could never overlap the forward pass
in flight. Staging packs all the lists of one use into a pinned host buffer and sends them in
one asynchronous copy; the device views it returns stay valid until the next `stage` call of
the same instance (one per step: the step's final device-to-host copy orders them).
"""

from __future__ import annotations

import torch


class Staging:
    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = torch.device(device), dtype
        self.cuda = self.device.type == "cuda"
        self.host: torch.Tensor | None = None
        self.dev: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None  # the last copy out of `host`

    def stage(self, *parts: list) -> list[torch.Tensor]:
        """One 1-D device tensor per list (views of one buffer on CUDA)."""
        sizes = [len(p) for p in parts]
        flat = [x for p in parts for x in p]
        if not self.cuda:
            return list(torch.tensor(flat, dtype=self.dtype, device=self.device).split(sizes))
        n = len(flat)
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy may still be queued behind the GPU's work
        if self.host is None or self.host.numel() < n:
            cap = max(n, 2 * (0 if self.host is None else self.host.numel()), 1024)
            self.host = torch.empty(cap, dtype=self.dtype, pin_memory=True)
            self.dev = torch.empty(cap, dtype=self.dtype, device=self.device)
        self.host.numpy()[:n] = flat  # numpy's view: 8x faster than a tensor of the list
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
        return list(self.dev[:n].split(sizes))


class HostCopy:
    """A device tensor on its way to pinned host memory; `tolist()` waits for it (once)."""

    def __init__(self, host: torch.Tensor, ready: torch.cuda.Event | None):
        self.host, self.ready = host, ready
        self._list: list | None = None

    def tolist(self) -> list:
        if self._list is None:
            if self.ready is not None:
                self.ready.synchronize()
            self._list = self.host.tolist()
        return self._list


def to_host(t: torch.Tensor) -> HostCopy:
    """Queue the copy of `t` to the host on the current stream."""
    if t.device.type != "cuda":
        return HostCopy(t, None)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return HostCopy(host, ready)
