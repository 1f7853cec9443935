"""A Hugging Face Hub cache built on disk, in the layout `huggingface_hub` itself writes
(`hub/models--org--name/{blobs,snapshots/<commit>,refs/<branch>}`), so that tests resolve Hub
ids with HF_HUB_OFFLINE=1 and never reach the network."""

from __future__ import annotations

import hashlib
from pathlib import Path


def cache_repo(hf_home: Path, repo_id: str, files: Path, commit: str, ref: str | None = "main") -> Path:
    """Every file of the directory `files` as the snapshot `commit` of `repo_id`; `ref` (a branch)
    points at it. Returns the snapshot directory."""
    repo = Path(hf_home) / "hub" / f"models--{repo_id.replace('/', '--')}"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(files).iterdir()):
        if not f.is_file():
            continue
        data = f.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()  # the Hub names LFS blobs by their sha256
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
