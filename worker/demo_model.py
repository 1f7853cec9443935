"""The built-in demo model: the trained reference model (docs/reference-model.md), shipped in the
package as one .tar.xz and unpacked into CDE_HOME on first use. Serving code only: the training
program (`cde.train`) imports `install` from here, never the other way round.

The archive is unpacked under a directory named by its own digest, so a package upgrade that
ships new weights unpacks them beside the old ones instead of serving a stale copy; the model
directory itself is always `cde-reference`, the name the server reports."""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
from importlib.resources import as_file, files
from pathlib import Path

from cde.shared.home import cde_home

DEMO_NAME = "cde-reference"
ARCHIVE = "reference.tar.xz"


# What an archive may unpack to: 32x its own size plus 64 MiB. Weights compress little (the
# reference model's 63 MB are 9.7 MB of xz, 6.5x); a crafted archive of zeros compresses ~7000x
# (305 KB wrote 2 GiB). A member is refused from its header, before any of it is written.
UNPACK_RATIO, UNPACK_SLACK = 32, 64 << 20
MAX_MEMBERS = 1000


class ArchiveError(ValueError):
    pass


def unpack_limit(archive_path: str | Path) -> int:
    return UNPACK_RATIO * Path(archive_path).stat().st_size + UNPACK_SLACK


def _extract_bounded(archive_path: str | Path, dest: Path) -> None:
    """Member by member, refusing the first one that would take the total past the limit (or a
    sparse one, whose header does not state what it writes)."""
    limit, total = unpack_limit(archive_path), 0
    with tarfile.open(archive_path, "r:*") as tar:
        for n, member in enumerate(tar):
            total += member.size
            if total > limit or n >= MAX_MEMBERS or member.issparse():
                raise ArchiveError(
                    f"{archive_path}: refused to unpack past {limit:,} bytes or {MAX_MEMBERS} files "
                    f"(at {member.name[:100]!r})"
                )
            tar.extract(member, dest, filter="data")


def install(archive_path: str | Path, home: str | Path, name: str) -> Path:
    """home/name holding the archive's files, unpacked once. Safe: tarfile's "data" filter refuses
    absolute paths, `..`, links that leave the directory and device files, and no archive unpacks
    past `unpack_limit` (what was written is removed). Atomic: unpacked into a
    temporary sibling, then renamed, so a reader never sees half a checkpoint and two processes
    racing both end with the same complete directory."""
    dest = Path(home) / name
    if (dest / "config.json").is_file():
        return dest
    tmp = Path(home) / f".{name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _extract_bounded(archive_path, tmp)
        if not (tmp / "config.json").is_file():
            raise ArchiveError(f"{archive_path}: no config.json at the archive's top level")
        try:
            os.replace(tmp, dest)
        except OSError:
            if not (dest / "config.json").is_file():  # not "another process installed it first"
                raise
    except tarfile.FilterError as exc:
        raise ArchiveError(f"{archive_path}: refused to unpack: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:12]


def demo_model_dir() -> Path:
    """CDE_HOME/demo/<digest>/cde-reference, unpacked from the packaged archive on first use."""
    with as_file(files("cde.demo").joinpath(ARCHIVE)) as archive:
        return install(archive, cde_home() / "demo" / _digest(archive), DEMO_NAME)
