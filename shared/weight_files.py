"""A checkpoint's weight files read as far as their headers, without torch: `cde serve` checks
them before it starts a worker (its gateway never imports torch), and the worker's loader words a
broken one the same way (worker/checkpoint.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import SafetensorError, safe_open


def unreadable(name: str, exc: Exception) -> str:
    """Why a weight file cannot be loaded: a cut-off download or an HTML error page saved under
    the name reads as a broken checkpoint, not as a crash in safetensors."""
    return f"{name} is not a readable safetensors file ({exc}); a download cut short? fetch it again"


INDEX = "model.safetensors.index.json"  # a sharded checkpoint's tensor -> file map


def weight_files(directory: Path) -> list[Path]:
    """The files a checkpoint's weights are read from: the shards its index names (a sharded
    checkpoint; other *.safetensors files beside them are not read), else every *.safetensors
    file. ValueError naming what is wrong: an index that does not parse, a shard not on disk or
    outside the directory, no weight file at all."""
    index = directory / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if not all(isinstance(n, str) for n in names):
                raise TypeError("a weight_map value is not a file name")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        # As written, not resolved: a Hub snapshot's shards are links into its cache's blobs.
        outside = [n for n in names if Path(n).is_absolute() or os.path.normpath(n).startswith("..")]
        if outside:
            raise ValueError(f"{index.name} names shard(s) outside the model directory: {outside}")
        if not names:
            raise ValueError(f"{index.name} names no shard")
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise ValueError(f"{index.name} names shard(s) that are not on disk: {missing}")
        return [directory / n for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    return files


def check_headers(directory: Path) -> None:
    """Every weight file's header parses and its tensors' bytes are all there (safetensors checks
    the header's offsets against the file's size); ValueError naming the first that is not."""
    for f in weight_files(directory):
        try:
            with safe_open(str(f), framework="numpy"):
                pass
        except SafetensorError as exc:
            raise ValueError(unreadable(f.name, exc)) from None
