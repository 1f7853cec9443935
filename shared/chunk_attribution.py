"""Chunk-level concept attribution from the engine's per-token records (reference:
`chunk_attribution`, `find_chunk_boundaries`, `ConceptLabels`). No torch: the gateway renders
`BlockResult.attribution` with this.

A record (one per kept generated token) is `{"token_id", "position", "step", "target_logit",
"known": [[id, weight, contribution], ...], "discovered": [...], "epsilon"}` with every concept
the heads reported (not cut to a top-k), so chunk sums are the reference's exactly.

Chunk semantics follow the reference: per position, contributions are divided by the total
absolute mass (known + discovered + |epsilon|); each concept's chunk contribution is the sum of
its normalised contributions over the chunk's committed positions divided by the chunk's length
in positions. Chunks are the 64-token diffusion blocks, or spans between `<|endofchunk|>` tokens
(the token itself excluded). Discovered concepts are labelled by `id + n_known`, the reference's
single id space for `concept_labels.parquet`.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

from cde.shared.config import ENDOFCHUNK_ID, PAGE

MIN_MASS = 1e-8  # the reference's clamp on a position's total absolute mass


class ConceptLabels:
    """concept id -> (name, head); missing ids read `Known: #id` / `Discovered: #id`."""

    def __init__(self, names: dict[int, tuple[str, str | None]] | None = None):
        self.names = names or {}

    def label(self, concept_id: int, concept_type: str) -> str:
        if concept_id not in self.names:
            return f"{'Discovered' if concept_type == 'discovered' else 'Known'}: #{concept_id}"
        name, head = self.names[concept_id]
        # As the reference: only a `head` of "unknown" reads Discovered (a row without a head
        # falls back to the type, which is never "unknown").
        return f"{'Discovered' if (head or concept_type) == 'unknown' else 'Known'}: {name}"


def load_concept_labels(path: str | Path) -> ConceptLabels:
    """The labels of a concept catalog file (`shared.catalog.Catalog.read`: the official parquet,
    or a CSV with `concept_id` (legacy `concept_idx`), `concept_name` and optionally `head`)."""
    from cde.shared.catalog import Catalog

    return ConceptLabels({c.concept_id: (c.name, c.head) for c in Catalog.read(path)})


def chunk_spans(records: list[dict], prompt_len: int, chunking: str) -> list[tuple[int, int]]:
    """[start, end) position spans over the generation, which ends after the last record."""
    if not records:
        return []
    end = records[-1]["position"] + 1
    if chunking == "block":
        cuts = range((prompt_len // PAGE + 1) * PAGE, end, PAGE)
        bounds = [prompt_len, *cuts, end]
        return list(pairwise(bounds))
    if chunking != "endofchunk":
        raise ValueError(f"unknown chunking {chunking!r} (block or endofchunk)")
    spans, start = [], prompt_len
    for r in records:
        if r["token_id"] == ENDOFCHUNK_ID:
            spans.append((start, r["position"]))
            start = r["position"] + 1
    spans.append((start, end))
    return [(s, e) for s, e in spans if e > s]


def _mass(r: dict) -> float:
    total = sum(abs(c) for _, _, c in r["known"]) + sum(abs(c) for _, _, c in r["discovered"]) + abs(r["epsilon"])
    return max(total, MIN_MASS)


def _entry(cid: int, kind: str, contribution: float, labels: ConceptLabels, n_known: int) -> dict:
    label_id = cid + n_known if kind == "discovered" else cid
    return {"id": cid, "type": kind, "label": labels.label(label_id, kind), "contribution": contribution}


def _ranked(entries: list[dict], top_k: int | None) -> list[dict]:
    # Stable sort by |contribution| over (known by id, then discovered by id): the reference's order.
    ranked = sorted(entries, key=lambda e: abs(e["contribution"]), reverse=True)
    return ranked if top_k is None else ranked[:top_k]


def chunk_concepts(
    records: list[dict], start: int, end: int, labels: ConceptLabels, n_known: int, top_k: int | None = None
) -> tuple[list[dict], float]:
    """Concepts of the chunk [start, end) ranked by |contribution|, and epsilon as a percentage
    of the total mass (mean over the chunk's committed positions)."""
    inside = [r for r in records if start <= r["position"] < end]
    sums: dict[str, dict[int, float]] = {"known": {}, "discovered": {}}
    eps_share = []
    for r in inside:
        mass = _mass(r)
        for kind, totals in sums.items():
            for cid, _, c in r[kind]:
                totals[cid] = totals.get(cid, 0.0) + c / mass
        eps_share.append(r["epsilon"] / mass)
    n = end - start
    entries = [
        _entry(cid, kind, total / n, labels, n_known) for kind in sums for cid, total in sorted(sums[kind].items())
    ]
    return _ranked(entries, top_k), 100.0 * sum(eps_share) / max(len(eps_share), 1)


def aggregate(
    records: list[dict],
    decode: Callable[[list[int]], str],
    *,
    prompt_len: int,
    chunking: str = "block",
    labels: ConceptLabels | None = None,
    n_known: int = 0,
    top_k: int | None = None,
    per_token: bool = False,
) -> dict:
    """Per-token records of one completion -> `{"chunks": [...], "tokens": [...]}`; start/end are
    offsets into the completion's tokens (end exclusive)."""
    labels = labels or ConceptLabels()
    records = sorted(records, key=lambda r: r["position"])
    chunks = []
    for start, end in chunk_spans(records, prompt_len, chunking):
        concepts, eps_pct = chunk_concepts(records, start, end, labels, n_known, top_k)
        ids = [r["token_id"] for r in records if start <= r["position"] < end]
        chunks.append(
            {
                "start": start - prompt_len,
                "end": end - prompt_len,
                "text": decode(ids),
                "concepts": concepts,
                "epsilon_pct": eps_pct,
            }
        )
    out: dict = {"chunks": chunks}
    if per_token:
        out["tokens"] = [token_attribution(r, decode, labels, n_known, top_k, prompt_len) for r in records]
    return out


def token_attribution(r: dict, decode, labels: ConceptLabels, n_known: int, top_k: int | None, prompt_len: int) -> dict:
    entries = [
        _entry(cid, kind, c, labels, n_known) | {"weight": w}
        for kind in ("known", "discovered")
        for cid, w, c in r[kind]
    ]
    return {
        "offset": r["position"] - prompt_len,
        "token_id": r["token_id"],
        "text": decode([r["token_id"]]),
        "target_logit": r["target_logit"],
        "epsilon": r["epsilon"],
        "concepts": _ranked(entries, top_k),
    }
