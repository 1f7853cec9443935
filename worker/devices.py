"""Which device `--device` means here, decided by what torch can use: one place for the rule, for
the worker and the one-process commands, and for `cde serve`, whose gateway never imports torch
(250 MB resident) and asks it in a child process: `python -m cde.worker.devices DEVICE` prints
the GPUs its workers get, one per line, or the reason DEVICE cannot be used (exit status 2)."""

from __future__ import annotations

import os
import sys

import torch


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        # Else torch's own AssertionError ("Torch not compiled with CUDA enabled") at the first tensor.
        why = "no GPU is visible" if torch.backends.cuda.is_built() else "this torch is a CPU build"
        raise ValueError(f"--device {device} but torch cannot use a GPU here: {why}")
    return device


def worker_gpus(device: str) -> list[str]:
    """The GPUs `cde serve` gives its workers, one each: none where `device` resolves to the CPU;
    where CUDA_VISIBLE_DEVICES is set, its names (an index or a GPU-UUID), as torch can use them."""
    if resolve_device(device) == "cpu":
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


if __name__ == "__main__":
    try:
        print("\n".join(worker_gpus(sys.argv[1])))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        sys.exit(2)
