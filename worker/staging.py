"""Host lists -> device tensors without waiting for the GPU.

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
        flat = torch.tensor([x for p in parts for x in p], dtype=self.dtype)
        if not self.cuda:
            return list(flat.to(self.device).split(sizes))
        n = flat.numel()
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy may still be queued behind the GPU's work
        if self.host is None or self.host.numel() < n:
            cap = max(n, 2 * (0 if self.host is None else self.host.numel()), 1024)
            self.host = torch.empty(cap, dtype=self.dtype, pin_memory=True)
            self.dev = torch.empty(cap, dtype=self.dtype, device=self.device)
        self.host[:n].copy_(flat)
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
        return list(self.dev[:n].split(sizes))
