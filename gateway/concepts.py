"""Concept labels from the checkpoint's optional `concept_labels.parquet` / `.csv`: names for
steering by label, and the labels attribution output shows. Without the file, concepts are
named by id: `12`, `#12` or `Known: #12`."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.errors import invalid
from shared.attribution import ConceptLabels as AttributionLabels
from shared.attribution import load_concept_labels

_BY_ID = re.compile(r"^(?:Known:\s*)?#?(\d{1,18})$")  # more digits: a label, not an id


class ConceptLabels:
    def __init__(self, labels: AttributionLabels | None = None):
        self.labels = labels or AttributionLabels()
        # Steering acts on the known head; in the labels file discovered concepts are the ids
        # past the known ones (or rows whose head is "unknown"), so they are not steering names.
        self.names = {name: cid for cid, (name, head) in self.labels.names.items() if head != "unknown"}

    @classmethod
    def load(cls, model_dir: str | Path | None, labels_path: str | Path | None = None) -> ConceptLabels:
        """`labels_path` (a parquet/CSV anywhere) wins over the file in the model directory."""
        if labels_path is not None:
            return cls(load_concept_labels(labels_path))
        for name in ("concept_labels.parquet", "concept_labels.csv"):
            path = Path(model_dir or "") / name
            if model_dir is not None and path.is_file():
                return cls(load_concept_labels(path))
        return cls()

    def resolve(self, concept: int | str, n_concepts: int, param: str) -> int:
        if isinstance(concept, str):
            m = _BY_ID.match(concept.strip())
            if m:
                concept = int(m.group(1))
            elif concept in self.names:
                concept = self.names[concept]
            else:
                raise invalid(f"unknown concept label {concept!r}", param)
        if not 0 <= concept < n_concepts:
            raise invalid(f"concept id {concept} is outside [0, {n_concepts})", param)
        return concept

    def label(self, concept_id: int) -> str:
        entry = self.labels.names.get(concept_id)
        return entry[0] if entry else f"Known: #{concept_id}"

    def catalog(self, n_concepts: int) -> list[dict]:
        """Every labelled concept by id; without a labels file, the known ids by number."""
        if not self.labels.names:
            return [{"id": cid, "type": "known", "label": self.label(cid)} for cid in range(n_concepts)]
        return [{"id": cid, "type": _concept_type(cid, head, n_concepts), "label": name}
                for cid, (name, head) in sorted(self.labels.names.items())]


def _concept_type(concept_id: int, head: str | None, n_concepts: int) -> str:
    # The labels file numbers discovered concepts past the known ones, or marks their head.
    return "discovered" if head == "unknown" or concept_id >= n_concepts else "known"
