"""A checkpoint's weight files read as far as their headers, without torch: `cde serve` checks
them before it starts a worker (its gateway never imports torch), and the worker's loader words a
broken one the same way (worker/checkpoint.py)."""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open


def unreadable(name: str, exc: Exception) -> str:
    """Why a weight file cannot be loaded: a cut-off download or an HTML error page saved under
    the name reads as a broken checkpoint, not as a crash in safetensors."""
    return f"{name} is not a readable safetensors file ({exc}); a download cut short? fetch it again"


def check_headers(directory: Path) -> None:
    """Every *.safetensors file's header parses and its tensors' bytes are all there (safetensors
    checks the header's offsets against the file's size); ValueError naming the first that is not."""
    for f in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="numpy"):
                pass
        except SafetensorError as exc:
            raise ValueError(unreadable(f.name, exc)) from None
