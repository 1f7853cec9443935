"""CDE, the Causal Diffusion Engine.

Installed, cde.gateway, cde.worker, cde.shared and cde.kernels are the repository's top-level
folders of those names (pyproject.toml's package-dir). A source tree run without an install
(PYTHONPATH=<repo>, as scripts/gpu_run.sh and the mutation canaries' scratch copies do) has no
installer to map them, so the checkout's root joins this package's path: `cde.gateway` is then
<repo>/gateway there too.
"""

from pathlib import Path as _Path

_root = _Path(__file__).resolve().parent.parent
if (_root / "worker" / "engine.py").is_file() and (_root / "gateway" / "app.py").is_file():
    __path__.append(str(_root))
