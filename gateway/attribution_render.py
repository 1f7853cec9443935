"""Turn a choice's per-token attribution records (sent by the worker with each block) into the
response's `attribution` object: chunk concepts, and per-token concepts when asked."""

from __future__ import annotations

from cde.gateway.concepts import ConceptLabels
from cde.shared.chunk_attribution import aggregate
from cde.shared.protocol import GenerateRequest, Heartbeat


def renderer(reqs: list[GenerateRequest], tokenizer, labels: ConceptLabels, info: Heartbeat):
    def render(index: int, records: list[dict]) -> dict | None:
        spec = reqs[index].attribution
        if spec is None:
            return None
        return aggregate(
            records,
            tokenizer.decode,
            prompt_len=len(reqs[index].prompt_ids),
            chunking=spec.chunking,
            labels=labels.labels,
            n_known=info.n_concepts,
            top_k=spec.top_k,
            per_token=spec.per_token,
        )

    return render
