"""The concept catalog: the official `concept_labels.parquet` (ten columns, reference:
`steerling.concepts.ConceptCatalog`), or a legacy labels CSV. Torch-free: the gateway searches
it, labels attribution with it and resolves steering labels and groups through it.

Search and groups follow the official code line by line in meaning: whole-word matches of each
query term, name weighted 3 and description 1, steerable known concepts by default, ties in the
order pandas' (unstable) sort leaves them, group members in file order with the focal id first.
The official package pins pandas 2.2, whose string methods are Python's `re` and `str.lower`,
which is what this module uses.
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from cde.shared.catalog_index import SearchIndex

log = logging.getLogger("cde.catalog")

COLUMNS = (
    "concept_id",
    "concept_name",
    "concept_description",
    "head",
    "public_group_id",
    "group_name",
    "is_steerable",
    "is_tone",
    "is_alignment",
    "is_demographic",
)
FILENAME = "concept_labels.parquet"
LEGACY_FILENAME = "concept_labels.csv"
ENV_VAR = "STEERLING_CONCEPTS_PATH"
HUB_REPO = "guidelabs/steerling"


PARQUET_MAGIC = b"PAR1"


def is_parquet(head: bytes) -> bool:
    """A parquet file by its first bytes, whatever its name (the official `ConceptCatalog.load`
    reads any path as parquet); anything else is read as a legacy CSV."""
    return head.startswith(PARQUET_MAGIC)


class CatalogError(ValueError):
    """A catalog file that is missing or does not have the columns it needs."""


@dataclass(frozen=True, slots=True)
class Concept:
    """One row, with the official `Concept`'s field names."""

    concept_id: int
    name: str
    description: str | None
    head: str | None  # "known" or "unknown"; None: a legacy file without the column
    group_id: int | None
    group_name: str | None
    is_steerable: bool
    is_tone: bool
    is_alignment: bool
    is_demographic: bool


def _flag(value: Any, default: bool) -> bool:
    if value is None or value == "":
        return default
    if isinstance(value, str):  # CSV cells
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def _optional_int(value: Any) -> int | None:
    # pandas reads a nullable integer column as float64 with NaN for the nulls.
    if value is None or value == "" or value != value:
        return None
    try:
        return int(float(value))
    except (TypeError, ValueError, OverflowError):  # a list cell, a word, an infinite float
        raise CatalogError(f"{value!r} is not an integer id") from None


def _head(row: Mapping) -> str | None:
    """None only for a file without the column (a legacy CSV: either head). A null in the column
    is "": no head filter matches it, as the official `df["head"] == head`, and it labels Known."""
    if "head" not in row:
        return None
    head = row["head"]
    return "" if head is None or head != head else str(head)


def _lowered(texts: list[str]) -> list[str]:
    """Texts lowered as the official search lowers them: pandas' `str.lower` on its Arrow-backed
    strings, one code point to one (Unicode's simple mapping: "İ" -> "i", a final "Σ" -> "σ"),
    where Python's `str.lower` maps "İ" to two and "Σ" by its context, the only two such."""
    return [_simple_lower(t) if _CONTEXTUAL.intersection(t) else t.lower() for t in texts]


_CONTEXTUAL = frozenset("\u0130\u03a3")  # İ, Σ


def _simple_lower(text: str) -> str:
    return "".join(c.lower()[0] for c in text)


def _null(value: Any) -> bool:
    return value is None or value != value  # NaN: pandas' null in a column it read as float


def _concept(row: Mapping) -> Concept:
    cid = _optional_int(row.get("concept_id", row.get("concept_idx")))  # legacy CSVs say concept_idx
    if cid is None or row.get("concept_name") is None:
        raise CatalogError("every row needs concept_id and concept_name")
    description, group_name = row.get("concept_description"), row.get("group_name")
    return Concept(
        concept_id=cid,
        name=str(row["concept_name"]),
        description=None if description is None else str(description),
        # Legacy label files had no steerability flag: every known concept in them could be
        # steered by label.
        head=_head(row),
        group_id=_optional_int(row.get("public_group_id")),
        group_name=None if group_name in (None, "") else str(group_name),
        is_steerable=_flag(row.get("is_steerable"), True),
        is_tone=_flag(row.get("is_tone"), False),
        is_alignment=_flag(row.get("is_alignment"), False),
        is_demographic=_flag(row.get("is_demographic"), False),
    )


def matches_head(c: Concept, head: str | None) -> bool:
    """`head` None matches any; a row without a head (a legacy file) matches either."""
    return head is None or c.head is None or c.head == head


def _ties_as_pandas(scores: list[int]) -> list[int]:
    """Indices of `scores` from highest to lowest, equal scores in the order that
    `DataFrame.sort_values(ascending=False)` leaves them: pandas reverses the int64 column,
    argsorts it with numpy's (unstable, hardware-dispatched) quicksort and reverses the result,
    so the same numpy call on the same values gives the official order."""
    reversed_scores = np.asarray(scores, dtype=np.int64)[::-1]
    positions = np.arange(len(scores))[::-1]
    return positions[reversed_scores.argsort(kind="quicksort")][::-1].tolist()


class Catalog:
    def __init__(self, concepts: Iterable[Concept] = ()):
        self.concepts = list(concepts)  # file order: search ties and group members follow it
        self.by_id: dict[int, Concept] = {}
        self._groups: dict[int, list[int]] = {}
        for c in self.concepts:
            if c.concept_id in self.by_id:
                raise CatalogError(f"concept_id {c.concept_id} appears more than once")
            self.by_id[c.concept_id] = c
            if c.group_id is not None:
                self._groups.setdefault(c.group_id, []).append(c.concept_id)
        names = _lowered([c.name for c in self.concepts])
        self._index = SearchIndex(list(zip(names, _lowered([c.description or "" for c in self.concepts]))))
        self._heads = np.array([c.head for c in self.concepts], dtype=object)
        self._headless = np.array([c.head is None for c in self.concepts], dtype=bool)
        self._steerable = np.array([c.is_steerable for c in self.concepts], dtype=bool)

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping]) -> Catalog:
        rows = list(rows)
        named = [r for r in rows if not ("concept_name" in r and _null(r["concept_name"]))]
        if len(named) < len(rows):  # the official reader keeps them, labelled "nan": here the #id label
            log.warning("concept catalog: %d row(s) without a concept_name left out", len(rows) - len(named))
        return cls(_concept(r) for r in named)

    @classmethod
    def read(cls, path: str | Path) -> Catalog:
        """`concept_labels.parquet` (the official schema), or a CSV with at least concept_id
        (or concept_idx) and concept_name; absent columns take the legacy defaults."""
        path = Path(path)
        try:
            with path.open("rb") as f:
                parquet = is_parquet(f.read(len(PARQUET_MAGIC)))
            if parquet:
                import pyarrow.parquet as pq

                columns = pq.read_table(path).to_pydict()
                rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
            else:  # utf-8-sig: a spreadsheet's export opens with a byte-order mark
                with path.open(newline="", encoding="utf-8-sig") as f:
                    reader = csv.DictReader(f)
                    header = set(reader.fieldnames or ())
                    if "concept_name" not in header or not header & {"concept_id", "concept_idx"}:
                        raise CatalogError(
                            "not a concept catalog: neither parquet nor a CSV whose header names "
                            "concept_id and concept_name"
                        )
                    rows = list(reader)
            if not rows:
                raise CatalogError("holds no concepts")
            return cls.from_rows(rows)
        except CatalogError as exc:
            raise CatalogError(f"{path}: {exc}") from None
        except (OSError, ValueError) as exc:
            raise CatalogError(f"{path}: not a readable concept catalog ({exc})") from None

    def __len__(self) -> int:
        return len(self.concepts)

    def __iter__(self) -> Iterator[Concept]:
        return iter(self.concepts)

    def get(self, concept_id: int) -> Concept | None:
        return self.by_id.get(concept_id)

    def search(
        self, query: str, *, limit: int = 10, steerable_only: bool = True, head: str | None = "known"
    ) -> list[Concept]:
        """`ConceptCatalog.search`: `head=None` searches both heads. The scores come from the index
        built at load (shared/catalog_index.py); LimitError for a query past its work bound."""
        return self._ranked(self._index.scores(query), limit, steerable_only, head)

    def suggest(self, text: str, limit: int = 3) -> list[Concept]:
        """Steerable known concepts that share whole words with `text`, ranked as search ranks
        them: a "did you mean" hint, bounded by the index alone (no regex)."""
        return self._ranked(self._index.scores(text, words_only=True), limit, True, "known")

    def _ranked(self, score: np.ndarray, limit: int, steerable_only: bool, head: str | None) -> list[Concept]:
        hit = score > 0
        if head is not None:
            hit &= (self._heads == head) | self._headless  # matches_head, elementwise
        if steerable_only:
            hit &= self._steerable
        rows = np.flatnonzero(hit)
        return [self.concepts[rows[i]] for i in _ties_as_pandas(score[rows].tolist())[:limit]]

    def group(self, concept_id: int) -> list[int]:
        """`ConceptCatalog.group`: the ids sharing this concept's group, the focal id first (just
        the focal id when it has no group). KeyError for an id the catalog lacks."""
        focal = self.by_id[concept_id]
        if focal.group_id is None:
            return [concept_id]
        return [concept_id] + [m for m in self._groups[focal.group_id] if m != concept_id]


def _from_hub(fetch: bool) -> Path | None:
    """`concept_labels.parquet` of the Hub repo. Fetched (and cached like the weights) only when
    `fetch`: the model itself came from the Hub, so the Hub is where its catalog lives too. Else,
    or when it cannot be fetched (offline, no network), only a copy already in the local cache
    counts: a server started from a directory never reaches the network."""
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache
    except ImportError:
        return None
    if fetch:
        try:
            return Path(hf_hub_download(HUB_REPO, FILENAME))
        except Exception as exc:
            log.warning(
                "concept catalog %s/%s not fetched (%s): labels read Known: #id", HUB_REPO, FILENAME, type(exc).__name__
            )
    found = try_to_load_from_cache(HUB_REPO, FILENAME)
    return Path(found) if isinstance(found, str) else None


def find_catalog(explicit: str | Path | None, model_dir: str | Path | None, fetch: bool = False) -> Path | None:
    """The official lookup order, with the model directory before the Hub: an explicit path
    (`--concept-labels`), $STEERLING_CONCEPTS_PATH, `concept_labels.parquet` (or the legacy
    `.csv`) beside the weights, then the Hub repo's file (fetched when `fetch`, else from the
    cache only). A path named explicitly must exist."""
    for source, given in (("--concept-labels", explicit), (ENV_VAR, os.environ.get(ENV_VAR) or None)):
        if given is not None:
            if not Path(given).is_file():
                raise CatalogError(f"{source}: no concept catalog at {given}")
            return Path(given)
    if model_dir is not None:
        for name in (FILENAME, LEGACY_FILENAME):
            if (Path(model_dir) / name).is_file():
                return Path(model_dir) / name
    return _from_hub(fetch)


def write_catalog(path: str | Path, rows: Iterable[Mapping]) -> Path:
    """Write rows (mappings keyed by the official column names; concept_id and concept_name
    required; head defaults to "known", is_steerable to true, the other flags to false and the
    rest to null) as a parquet file in the official schema. Written beside and renamed into
    place, so a reader never sees half a file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    concepts = Catalog.from_rows(rows).concepts
    table = pa.table(
        {
            "concept_id": pa.array([c.concept_id for c in concepts], pa.int64()),
            "concept_name": pa.array([c.name for c in concepts], pa.string()),
            "concept_description": pa.array([c.description for c in concepts], pa.string()),
            "head": pa.array([c.head or "known" for c in concepts], pa.string()),
            "public_group_id": pa.array([c.group_id for c in concepts], pa.int64()),
            "group_name": pa.array([c.group_name for c in concepts], pa.string()),
            **{flag: pa.array([getattr(c, flag) for c in concepts], pa.bool_()) for flag in COLUMNS[6:]},
        }
    )
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path
