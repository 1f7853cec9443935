"""Chunk-level concept attribution from the engine's per-token records (reference:
`chunk_attribution`, `find_chunk_boundaries`, `ConceptLabels`). No torch: the gateway renders
the `PackedAttribution` of a completion's blocks with this (numpy over the packed arrays; the
per-token record dicts of tests are packed first).

A token's attribution holds every concept the heads reported (not cut to a top-k), so chunk sums
add the reference's terms in the reference's order; in float64, where the reference adds in
float32, so the two differ in the last float32 bits (~1e-6 relative; the parity tests allow 1e-4).

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

import numpy as np
from cde.shared.config import ENDOFCHUNK_ID, PAGE
from cde.shared.packed_attribution import HEADS, PackedAttribution

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


Records = PackedAttribution | list[dict]


def packed(records: Records) -> PackedAttribution:
    """Per-token record dicts (tests, the reference's shapes) as one packed block; a packed one as is."""
    return records if isinstance(records, PackedAttribution) else PackedAttribution.from_records(records)


def chunk_spans(records: Records, prompt_len: int, chunking: str, end: int | None = None) -> list[tuple[int, int]]:
    """[start, end) position spans over the generation (records in position order), which ends at
    `end` (where <|eot_id|> ended it, as the reference's last chunk), else after the last record."""
    a = packed(records).arrays()
    if end is None:
        if not len(a["positions"]):
            return []
        end = int(a["positions"][-1]) + 1
    if chunking == "block":
        if end <= prompt_len:  # <|eot_id|> first: no span, as the reference's find_chunk_boundaries
            return []
        cuts = range((prompt_len // PAGE + 1) * PAGE, end, PAGE)
        bounds = [prompt_len, *cuts, end]
        return list(pairwise(bounds))
    if chunking != "endofchunk":
        raise ValueError(f"unknown chunking {chunking!r} (block or endofchunk)")
    # The reference's find_chunk_boundaries: a span before every <|endofchunk|>, even an empty one
    # (two in a row, or one first), then the rest unless it is empty.
    spans, start = [], prompt_len
    for p in a["positions"][a["token_ids"] == ENDOFCHUNK_ID].tolist():
        if p >= end:
            break
        spans.append((start, p))
        start = p + 1
    return spans + [(start, end)] if end > start else spans


def _mass(a: dict[str, np.ndarray], rows: np.ndarray) -> np.ndarray:
    """The total absolute mass of each of these positions, summed in the order of the reference's
    loop (known, then discovered, then epsilon): cumsum adds one value after another, like
    Python's sum, so every total is the same double."""
    totals = []
    for head in HEADS:
        c = np.abs(a[f"{head}_contributions"][rows])
        totals.append(np.cumsum(c, axis=1)[:, -1] if c.shape[1] else np.zeros(c.shape[0]))
    return np.maximum(totals[0] + totals[1] + np.abs(a["epsilon"][rows]), MIN_MASS)


def _top(values: np.ndarray, top_k: int | None) -> np.ndarray:
    """Indices of `values` by |value|, largest first, ties in index order (a stable sort), cut to
    top_k: only the candidates at or above the top_k-th magnitude are sorted."""
    key = -np.abs(values)
    if top_k is not None and top_k < len(key):
        kth = np.partition(key, top_k - 1)[top_k - 1] if top_k > 0 else -np.inf
        candidates = np.flatnonzero(key <= kth)  # in index order: ties keep it through the stable sort
        return candidates[np.argsort(key[candidates], kind="stable")][:top_k]
    return np.argsort(key, kind="stable")


def _entry(cid: int, kind: str, contribution: float, labels: ConceptLabels, n_known: int) -> dict:
    label_id = cid + n_known if kind == "discovered" else cid
    return {"id": cid, "type": kind, "label": labels.label(label_id, kind), "contribution": contribution}


def _ranked(entries: list[dict], top_k: int | None) -> list[dict]:
    # Stable sort by |contribution| over (known by id, then discovered by id): the reference's order.
    ranked = sorted(entries, key=lambda e: abs(e["contribution"]), reverse=True)
    return ranked if top_k is None else ranked[:top_k]


def chunk_concepts(
    records: Records, start: int, end: int, labels: ConceptLabels, n_known: int, top_k: int | None = None
) -> tuple[list[dict], float | None]:
    """Concepts of the chunk [start, end) ranked by |contribution|, and epsilon as a percentage
    of the total mass (mean over the chunk's committed positions; None without any: the
    reference's mean over none is NaN, which JSON cannot carry).

    Vectorized, with the reference loop's arithmetic: each concept's normalised contributions
    are added in token order (`np.bincount` adds one after another), the ranking is a stable
    sort over (known by id, then discovered by id), and only the top_k entries are labelled."""
    a = packed(records).arrays()
    inside = np.flatnonzero((a["positions"] >= start) & (a["positions"] < end))
    # Token order whatever the records' (a running view keeps them in commit order): same doubles.
    inside = inside[np.argsort(a["positions"][inside], kind="stable")]
    mass = _mass(a, inside)
    n = end - start
    ids, kinds, totals = [], [], []
    for head in HEADS:
        uniq, where = np.unique(a[f"{head}_ids"][inside].ravel(), return_inverse=True)
        # bincount adds in index order, one after another: the reference loop's order of terms.
        normalised = (a[f"{head}_contributions"][inside] / mass[:, None]).ravel()
        ids.append(uniq)
        kinds.append(np.full(len(uniq), head == "discovered"))
        totals.append(np.bincount(where.ravel(), weights=normalised, minlength=len(uniq)) / n)
    all_totals = np.concatenate(totals)
    # Stable by -|c| == Python's stable sorted(key=abs, reverse=True) over (known, discovered) by id.
    order = _top(all_totals, top_k)
    picked = zip(np.concatenate(ids)[order].tolist(), np.concatenate(kinds)[order].tolist(), all_totals[order].tolist())
    concepts = [_entry(cid, HEADS[kind], value, labels, n_known) for cid, kind, value in picked]
    eps_share = (a["epsilon"][inside] / mass).tolist()
    return concepts, (100.0 * sum(eps_share) / len(eps_share) if eps_share else None)


def aggregate(
    records: Records,
    decode: Callable[[list[int]], str],
    *,
    prompt_len: int,
    chunking: str = "block",
    labels: ConceptLabels | None = None,
    n_known: int = 0,
    top_k: int | None = None,
    per_token: bool = False,
    end: int | None = None,
) -> dict:
    """The attribution of one completion (packed, or per-token record dicts) -> `{"chunks": [...],
    "tokens": [...]}`; start/end are offsets into the generation (end exclusive; `end`, absolute:
    where <|eot_id|> ended it, see chunk_spans)."""
    labels = labels or ConceptLabels()
    block = packed(records)
    pos = block.arrays()["positions"]
    if len(pos) > 1 and not (pos[1:] > pos[:-1]).all():
        block = block.take(np.argsort(pos, kind="stable"))
    a = block.arrays()
    chunks = []
    for start, stop in chunk_spans(block, prompt_len, chunking, end):
        concepts, eps_pct = chunk_concepts(block, start, stop, labels, n_known, top_k)
        ids = a["token_ids"][(a["positions"] >= start) & (a["positions"] < stop)].tolist()
        chunks.append(
            {
                "start": start - prompt_len,
                "end": stop - prompt_len,
                "text": decode(ids),
                "concepts": concepts,
                "epsilon_pct": eps_pct,
            }
        )
    out: dict = {"chunks": chunks}
    if per_token:
        out["tokens"] = [token_attribution(r, decode, labels, n_known, top_k, prompt_len) for r in block]
    return out


def token_attribution(
    r: dict, decode: Callable[[list[int]], str], labels: ConceptLabels, n_known: int, top_k: int | None, prompt_len: int
) -> dict:
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
