"""The split-K GEMM configs worker/gemm_tuning.py picked, kept under CDE_HOME, so that a restart
pins them without timing every candidate of every weight shape again (~30 each), and serves with
the configs it served with before (vLLM keeps its Triton kernels' tuned configs per device in files
for the same reasons).

One JSON file per GPU model and software: its name digests the device's name and compute
capability, torch's and Triton's versions and the sources of CDE's kernels, any of which may change
which config is fastest or whether it builds. Each entry is keyed by what was tuned: the chain's
name and both operands' dtypes and shapes. A stored config is used only while it is still among
the candidates and its products still agree with the reference; otherwise the shape is tuned again
and the entry replaced. Delete the file to tune every shape again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from cde.shared.home import KERNELS_DIR, cde_home, kernels_digest

log = logging.getLogger("cde.gemm_tuning")


def tuning_key(name: str, a: torch.Tensor, b: torch.Tensor, swiglu: bool) -> str:
    """What a pick was tuned for: the chain's name and the operands (a [M, K], b [N, K])."""
    operands = " ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in (a, b))
    return f"{name} | {operands}{' | swiglu' if swiglu else ''}"


@dataclass(frozen=True)
class Pick:
    config: dict
    ms: float


class TuningCache:
    """The picks in one JSON file ({key: {"config", "ms", "tuned_at"}}); `path` None: nothing kept."""

    def __init__(self, path: Path | None):
        self.path = path

    @classmethod
    def for_device(cls, device: torch.device) -> TuningCache:
        """CDE_HOME/gemm-tuning/<digest of this GPU and software>.json"""
        import triton  # on CUDA machines, where tuning runs

        name = torch.cuda.get_device_name(device)
        parts = (name, str(torch.cuda.get_device_capability(device)), torch.__version__, triton.__version__)
        digest = hashlib.sha256("\0".join((*parts, kernels_digest(KERNELS_DIR))).encode()).hexdigest()[:16]
        slug = "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()
        return cls(cde_home() / "gemm-tuning" / f"{slug}-{digest}.json")

    def _entries(self) -> dict:
        if self.path is None or not self.path.exists():
            return {}
        try:
            entries = json.loads(self.path.read_text())
            return entries if isinstance(entries, dict) else {}
        except (OSError, ValueError) as exc:  # unreadable or half-written by hand: tune again
            log.warning("gemm_tuning: %s unreadable (%s); tuning again", self.path, exc)
            return {}

    def get(self, key: str) -> Pick | None:
        entry = self._entries().get(key)
        try:
            return Pick(dict(entry["config"]), float(entry["ms"])) if isinstance(entry, dict) else None
        except (TypeError, KeyError, ValueError):  # an entry edited by hand: tune again
            return None

    def put(self, key: str, pick: Pick) -> None:
        """Adds or replaces `key`'s pick: the file is rewritten whole and renamed into place, so a
        worker that reads it meanwhile sees the old file or the new one, never half of one. The
        read, change and rename hold an exclusive lock (a `.lock` file beside it): workers that
        tune at once, one per GPU, would otherwise each write back what they read and drop the
        others' picks (4 processes of 60 picks each kept 100-173 of the 240 without it)."""
        if self.path is None:
            return
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_suffix(".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                entries = self._entries()
                entries[key] = {
                    "config": pick.config,
                    "ms": pick.ms,
                    "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                }
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-", suffix=".json")
                with os.fdopen(fd, "w") as f:
                    json.dump(entries, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
        except OSError as exc:  # a read-only CDE_HOME: the pick holds for this process only
            log.warning("gemm_tuning: cannot keep the pick in %s (%s)", self.path, exc)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
