"""CDE_HOME: where CDE keeps what it writes once and reuses (the demo model, the compile caches).

A container mounts one volume there, and a restart finds its compiled kernels instead of paying
for them again. No torch here: the CLI sets the cache variables before any command imports it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"  # cde.kernels, installed or editable


def cde_home() -> Path:
    return Path(os.environ.get("CDE_HOME") or Path.home() / ".cache" / "cde")


def use_compile_caches() -> None:
    """Inductor's FX-graph/autotune cache and Triton's kernel cache under CDE_HOME, unless the
    operator pointed them elsewhere. Their defaults (/tmp/torchinductor_$USER, ~/.triton) sit
    outside any volume a container keeps, so every restart of a pod compiled from scratch.
    Inductor's directory is named by the digest of CDE's custom ops (see kernels_digest)."""
    root = cde_home() / "compile-cache"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / f"inductor-{kernels_digest(KERNELS_DIR)}"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))


def kernels_digest(kernels_dir: Path) -> str:
    """A digest of the sources of CDE's custom ops (cde.kernels). Inductor's FX-graph cache keys a
    compiled graph by the graph, torch and its config, not by what a custom op it calls is: after an
    upgrade that changed an op's signature, a kept cache would hand back code calling the old one
    (`cde::fp8_matmul() expected at most 6 argument(s) but received 7`)."""
    digest = hashlib.sha256()
    for path in sorted(kernels_dir.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
