"""Documents packed into fixed-length rows: every document starts on a 64-token block boundary
at position 0 (positions restart per document and attention never crosses documents, so a
packed document is computed exactly as a lone prompt is at inference). A chat document is
followed by TRAIL positions to the end of its last block; plain text fills the rest of a row.

Batch `step` of a run is a pure function of (seed, step): resuming needs no data state, and
DataLoader workers may build batches in any order."""

from __future__ import annotations

import random

import torch

from cde.shared.config import EOS_ID, PAD_ID, PAGE
from cde.train.samples import PROMPT, TEXT, TRAIL, Doc, draw


def pack_row(docs: list[Doc], length: int, n_concepts: int) -> dict[str, torch.Tensor]:
    n_docs = length // PAGE
    ids = torch.full((length,), PAD_ID, dtype=torch.long)
    kinds = torch.full((length,), PROMPT, dtype=torch.int8)
    doc_of = torch.full((length,), -1, dtype=torch.int16)
    pos = torch.zeros(length, dtype=torch.int32)
    labels = torch.zeros(n_docs, n_concepts, dtype=torch.bool)
    steer = torch.full((n_docs,), -1, dtype=torch.long)
    at = 0
    for d, doc in enumerate(docs):
        n = min(len(doc.ids), length - at)
        span = -(-n // PAGE) * PAGE if doc.kinds[-1] != TEXT else n
        ids[at : at + n] = torch.tensor(doc.ids[:n])
        kinds[at : at + n] = torch.tensor(doc.kinds[:n], dtype=torch.int8)
        ids[at + n : at + span] = EOS_ID
        kinds[at + n : at + span] = TRAIL
        doc_of[at : at + span] = d
        pos[at : at + span] = torch.arange(span, dtype=torch.int32)
        labels[d, doc.labels] = True
        steer[d] = doc.steer
        at += span
    return {"ids": ids, "kinds": kinds, "doc": doc_of, "pos": pos, "labels": labels, "steer": steer}


def row_docs(rng: random.Random, length: int, pending: list[Doc]) -> list[Doc]:
    """Documents for one row; a chat document that does not fit is left in `pending` for the next."""
    docs: list[Doc] = []
    room = length
    while room >= PAGE:
        doc = pending.pop() if pending else draw(rng, room)
        if doc.kinds[-1] == TEXT:  # plain text: cut to what is left of the row, whole blocks
            doc.ids, doc.kinds = doc.ids[: room // PAGE * PAGE], doc.kinds[: room // PAGE * PAGE]
            docs.append(doc)
            break
        need = -(-len(doc.ids) // PAGE) * PAGE
        if need > room:
            pending.append(doc)
            break
        docs.append(doc)
        room -= need
    return docs


def make_batch(seed: int, step: int, rows: int, length: int, n_concepts: int) -> dict[str, torch.Tensor]:
    rng = random.Random(f"{seed}:{step}")
    pending: list[Doc] = []
    packed = [pack_row(row_docs(rng, length, pending), length, n_concepts) for _ in range(rows)]
    return {k: torch.stack([p[k] for p in packed]) for k in packed[0]}


class Batches(torch.utils.data.Dataset):
    """Map-style: item i is the batch of step i (for a DataLoader with batch_size=None)."""

    def __init__(self, seed: int, rows: int, length: int, n_concepts: int, steps: int):
        self.seed, self.rows, self.length, self.n_concepts, self.steps = seed, rows, length, n_concepts, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> dict[str, torch.Tensor]:
        return make_batch(self.seed, step, self.rows, self.length, self.n_concepts)
