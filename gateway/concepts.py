"""Concept labels for steering by name: the checkpoint's optional `concept_labels.csv` (or
`.parquet` when pyarrow is installed), columns `concept_id`, `concept_name`[, `head`].
Without labels, concepts are named by id: `12`, `#12` or `Known: #12`."""

from __future__ import annotations

import csv
import re
from pathlib import Path

from gateway.errors import invalid

_BY_ID = re.compile(r"^(?:Known:\s*)?#?(\d+)$")


class ConceptLabels:
    def __init__(self, names: dict[str, int] | None = None):
        self.names = names or {}

    @classmethod
    def load(cls, model_dir: str | Path | None) -> ConceptLabels:
        if model_dir is None:
            return cls()
        rows: list[dict] = []
        csv_path, pq_path = Path(model_dir) / "concept_labels.csv", Path(model_dir) / "concept_labels.parquet"
        if csv_path.is_file():
            with open(csv_path, newline="", encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
        elif pq_path.is_file():
            try:
                import pyarrow.parquet as pq
            except ImportError:
                return cls()
            rows = pq.read_table(pq_path).to_pylist()
        # Steering acts on the known head only, so discovered-concept labels are not names here.
        return cls({str(r["concept_name"]): int(r["concept_id"]) for r in rows
                    if str(r.get("head", "known")).lower() in ("known", "")})

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
