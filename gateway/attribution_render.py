"""Turn a choice's attribution (the packed arrays the worker sends with each block) into the
response's `attribution` object: chunk concepts, and per-token concepts when asked."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import numpy as np
from cde.gateway.attribution_schemas import Attribution
from cde.gateway.concepts import ConceptLabels
from cde.gateway.model_info import ModelInfo
from cde.shared.chunk_attribution import aggregate
from cde.shared.packed_attribution import PackedAttribution
from cde.shared.protocol import GenerateRequest
from cde.shared.tokenizer import Tokenizer

# (choice index, its blocks' attribution, the tokens of its completion, where <|eot_id|> ended it
# (BlockResult.end_position) or None) -> its `attribution`
Render = Callable[[int, list[PackedAttribution], int, int | None], Attribution | None]


def renderer(reqs: list[GenerateRequest], tokenizer: Tokenizer, labels: ConceptLabels, info: ModelInfo) -> Render:
    def render(
        index: int, blocks: list[PackedAttribution], completion_tokens: int, end: int | None
    ) -> Attribution | None:
        spec = reqs[index].attribution
        if spec is None:
            return None
        prompt_len = len(reqs[index].prompt_ids)
        records: PackedAttribution | list = []
        if blocks:  # the completion's tokens only (a stop string may have cut it short of the last
            # block's): its first tokens by position, which skip the positions never unmasked
            joined = PackedAttribution.join(blocks)
            order = np.argsort(joined.arrays()["positions"], kind="stable")
            records = joined.take(order[:completion_tokens])
        attribution = aggregate(
            records,
            tokenizer.decode,
            prompt_len=prompt_len,
            chunking=spec.chunking,
            labels=labels.labels,
            n_known=info.n_concepts,
            top_k=spec.top_k,
            per_token=spec.per_token,
            end=end,
        )
        return cast(Attribution, attribution)  # shared/ builds it as a plain dict, of this shape

    return render
