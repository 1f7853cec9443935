"""The demo model's directory is named by the digest of its archive (CDE_HOME/demo/<digest>), so
a package that ships new weights never serves the old copy: the digest must change with any byte
of the archive, the last one of a multi-MiB file as much as the first. The reference is hashlib's
SHA-256 over the whole file."""

import hashlib
import random
from importlib.resources import as_file, files

from cde.worker.demo_model import ARCHIVE, _digest


def sha256_prefix(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def test_the_shipped_archive_is_named_by_the_digest_of_all_its_bytes():
    with as_file(files("cde.demo").joinpath(ARCHIVE)) as archive:
        assert archive.stat().st_size > 1 << 20  # larger than one read: the loop over chunks matters
        assert _digest(archive) == sha256_prefix(archive.read_bytes())


def test_changing_any_byte_changes_the_digest(tmp_path):
    data = bytearray(random.Random(0).randbytes(3 * (1 << 20) + 17))
    path = tmp_path / "archive.tar.xz"
    seen = set()
    for offset in [None, 0, (1 << 20) - 1, 1 << 20, 2 * (1 << 20) + 5, len(data) - 1]:
        changed = bytearray(data)
        if offset is not None:
            changed[offset] ^= 0xFF
        path.write_bytes(changed)
        digest = _digest(path)
        assert digest == sha256_prefix(bytes(changed)) and digest not in seen, offset
        seen.add(digest)
