"""A concept catalog file as a worker sends it to the gateways that connect (so that a gateway on
another host, started without --model, still has names, search and groups): the file's bytes,
their sha256 (in every Heartbeat: gateways compare workers by it) and the slices that cross the
wire, each well under the frame limit. Torch-free; both ends bound the size."""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cde.shared.catalog import Catalog, CatalogError, is_parquet
from cde.shared.protocol import CatalogPart

# The official concept_labels.parquet (134,928 concepts) is a few MB; this bounds what a worker
# keeps in memory and what a gateway accepts from one.
MAX_CATALOG_BYTES = 64 << 20
PART_BYTES = 1 << 20  # per CatalogPart, a quarter of shared.wire.MAX_FRAME_BYTES
SUFFIXES = (".parquet", ".csv")


@dataclass(frozen=True)
class CatalogFile:
    data: bytes
    suffix: str  # how Catalog.read reads it
    digest: str

    @classmethod
    def of(cls, data: bytes, suffix: str) -> CatalogFile:
        return cls(data, suffix, hashlib.sha256(data).hexdigest())

    @classmethod
    def read(cls, path: str | Path) -> CatalogFile:
        path = Path(path)
        try:
            size = path.stat().st_size
            if size > MAX_CATALOG_BYTES:
                raise CatalogError(f"{path}: {size} bytes, over the {MAX_CATALOG_BYTES}-byte limit for a catalog")
            data = path.read_bytes()
            return cls.of(data, ".parquet" if is_parquet(data) else ".csv")
        except OSError as exc:
            raise CatalogError(f"{path}: cannot read the concept catalog ({exc})") from None

    def part(self, offset: int) -> CatalogPart:
        """The slice at `offset` (empty past the end or for a negative offset)."""
        data = self.data[offset : offset + PART_BYTES] if offset >= 0 else b""
        return CatalogPart(self.digest, offset, len(self.data), self.suffix, data)

    def catalog(self) -> Catalog:
        """Parsed as `Catalog.read` parses a file (which it needs: pyarrow reads parquet from a path)."""
        if self.suffix not in SUFFIXES:
            raise CatalogError(f"a catalog file is {' or '.join(SUFFIXES)}, not {self.suffix!r}")
        with tempfile.NamedTemporaryFile(suffix=self.suffix) as f:
            f.write(self.data)
            f.flush()
            return Catalog.read(f.name)
