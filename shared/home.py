"""CDE_HOME: where CDE keeps what it writes once and reuses (the demo model, the compile caches).

A container mounts one volume there, and a restart finds its compiled kernels instead of paying
for them again. No torch here: the CLI sets the cache variables before any command imports it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cde_home() -> Path:
    return Path(os.environ.get("CDE_HOME") or Path.home() / ".cache" / "cde")


def use_compile_caches() -> None:
    """Inductor's FX-graph/autotune cache and Triton's kernel cache under CDE_HOME, unless the
    operator pointed them elsewhere. Their defaults (/tmp/torchinductor_$USER, ~/.triton) sit
    outside any volume a container keeps, so every restart of a pod compiled from scratch."""
    root = cde_home() / "compile-cache"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
