"""The served concept catalog as the API sees it: listing and search entries, steering labels and
groups resolved to known-concept ids (400 naming the field otherwise), and the labels attribution
output shows. Without a catalog, concepts are known by id: `12`, `#12` or `Known: #12`."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from cde.gateway.errors import invalid
from cde.shared.catalog import Catalog, Concept, find_catalog, matches_head
from cde.shared.chunk_attribution import ConceptLabels as AttributionLabels
from cde.shared.limits import MAX_CONCEPT_LABEL_CHARS, LimitError

_BY_ID = re.compile(r"^(?:Known:\s*)?#?([0-9]{1,18})$")  # ASCII digits; more of them: a label, not an id
_PREFIX = "Known: "  # how attribution output labels a known concept


class ConceptLabels:
    def __init__(self, catalog: Catalog | None = None):
        self.catalog = catalog or Catalog()
        self.labels = AttributionLabels({c.concept_id: (c.name, c.head) for c in self.catalog})
        # Steering acts on the known head, so only known concepts are steering names.
        self._names: dict[str, list[Concept]] = {}
        self._folded: dict[str, list[Concept]] = {}
        for c in self.catalog:
            if c.head != "unknown":
                self._names.setdefault(c.name, []).append(c)
                self._folded.setdefault(c.name.casefold(), []).append(c)

    @classmethod
    def load(
        cls, model_dir: str | Path | None, labels_path: str | Path | None = None, fetch: bool = False
    ) -> ConceptLabels:
        """The catalog in the official lookup order (`shared.catalog.find_catalog`), or none."""
        path = find_catalog(labels_path, model_dir, fetch)
        return cls(Catalog.read(path) if path is not None else None)

    def resolve(self, concept: int | str, n_concepts: int, param: str) -> int:
        """An id, `#id`, `Known: #id`, or a known concept's catalog name (also as `Known: name`,
        the attribution label; case-insensitive when no name matches exactly). A name as written
        comes first: a concept named "1984" is that concept, not id 1984."""
        if isinstance(concept, str):
            if len(concept) > MAX_CONCEPT_LABEL_CHARS:
                raise invalid(f"a concept label is at most {MAX_CONCEPT_LABEL_CHARS} characters", param)
            concept = self._by_label(concept, param)
        if not 0 <= concept < n_concepts:
            raise invalid(f"concept id {concept} is outside [0, {n_concepts})", param)
        return concept

    def _by_label(self, label: str, param: str) -> int:
        m = None if label.removeprefix(_PREFIX) in self._names else _BY_ID.match(label.strip())
        return int(m.group(1)) if m else self._by_name(label, param)

    def _by_name(self, label: str, param: str) -> int:
        name = label.removeprefix(_PREFIX)
        found = self._names.get(name) or self._folded.get(name.casefold(), [])
        if len(found) > 1:  # prefer the steerable one when only one is
            found = [c for c in found if c.is_steerable] or found
        if len(found) == 1:
            return found[0].concept_id
        if found:
            ids = ", ".join(str(c.concept_id) for c in found[:8])
            raise invalid(f"concept label {label!r} names several known concepts ({ids}): give the id", param)
        near = [f"{c.name!r} (#{c.concept_id})" for c in self.catalog.suggest(name)]
        hint = f"; search finds {', '.join(near)}" if near else "; find names with GET /v1/concepts?search="
        raise invalid(f"unknown concept label {label!r}{hint}", param)

    def expand_groups(self, concepts: list[int], n_concepts: int, param: str = "steering.group") -> list[int]:
        """Each concept followed by the rest of its catalog group (`ConceptCatalog.group`), without
        repeats, so the first concept stays first (the focal one of a suppress mask)."""
        if not len(self.catalog):
            raise invalid(
                "group steering needs a concept catalog, and none is loaded (give --concept-labels, "
                "set STEERLING_CONCEPTS_PATH, or put concept_labels.parquet beside the weights)",
                param,
            )
        if not concepts:
            raise invalid("group expands steering.concepts to their groups, and none are given", param)
        out: list[int] = []
        for cid in concepts:
            focal = self.catalog.get(cid)
            if focal is None:
                raise invalid(f'concept {cid} is not in the concept catalog: steer it without "group": true', param)
            for member in self.catalog.group(cid):  # a concept of no group is its own group, as officially
                if self.catalog.get(member).head == "unknown" or not 0 <= member < n_concepts:
                    raise invalid(
                        f"group {focal.group_id} ({focal.group_name!r}) of concept {cid} includes concept "
                        f"{member}, which is not a known concept in [0, {n_concepts}): only known "
                        f"concepts steer",
                        param,
                    )
                if member not in out:
                    out.append(member)
        return out

    def label(self, concept_id: int) -> str:
        c = self.catalog.get(concept_id)
        return c.name if c else f"Known: #{concept_id}"

    def entry(self, concept_id: int, n_concepts: int) -> dict:
        """Every catalog field of the concept (null without a catalog row), with the API's id,
        type ("known" or "discovered") and label."""
        c = self.catalog.get(concept_id)
        discovered = (c is not None and c.head == "unknown") or concept_id >= n_concepts
        out = {"id": concept_id, "type": "discovered" if discovered else "known", "label": self.label(concept_id)}
        if c is None:
            return out | dict.fromkeys(
                (
                    "name",
                    "description",
                    "head",
                    "group_id",
                    "group_name",
                    "is_steerable",
                    "is_tone",
                    "is_alignment",
                    "is_demographic",
                )
            )
        return out | {
            "name": c.name,
            "description": c.description,
            "head": c.head,
            "group_id": c.group_id,
            "group_name": c.group_name,
            "is_steerable": c.is_steerable,
            "is_tone": c.is_tone,
            "is_alignment": c.is_alignment,
            "is_demographic": c.is_demographic,
        }

    def group(self, concept_id: int) -> dict | None:
        c = self.catalog.get(concept_id)
        if c is None or c.group_id is None:
            return None
        return {"id": c.group_id, "name": c.group_name, "concept_ids": self.catalog.group(concept_id)}

    def search(self, query: str, n_concepts: int, *, limit: int, steerable_only: bool, head: str | None) -> list[dict]:
        """The official ranking over the catalog. Without one there are no names: a query that
        reads as an id finds that known concept."""
        if len(self.catalog):
            try:
                hits = self.catalog.search(query, limit=limit, steerable_only=steerable_only, head=head)
            except LimitError as exc:  # a query past the index's work bound
                raise invalid(str(exc), exc.param) from None
            return [self.entry(c.concept_id, n_concepts) for c in hits]
        m = _BY_ID.match(query.strip())
        found = m is not None and int(m.group(1)) < n_concepts and head in (None, "known")
        return [self.entry(int(m.group(1)), n_concepts)] if found else []

    def listing(self, n_concepts: int, *, steerable_only: bool, head: str | None) -> Iterator[dict]:
        """Every catalog concept in file order (without a catalog, the known ids), filtered."""
        if not len(self.catalog):
            ids = range(n_concepts) if head in (None, "known") else range(0)
            return (self.entry(cid, n_concepts) for cid in ids)
        return (
            self.entry(c.concept_id, n_concepts)
            for c in self.catalog
            if matches_head(c, head) and (c.is_steerable or not steerable_only)
        )
