"""`stream_denoise`: the StepResults of one choice as SSE `step` events. Each says which
completion offsets the step unmasked and with which tokens, and, when the request asked for
attribution, the running concept view of the block being denoised (the same chunk arithmetic as
the final attribution, over the tokens committed so far) plus, with `per_token`, each new token's
own concepts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from cde.gateway.attribution_schemas import ConceptContribution, StepAttribution, TokenAttribution
from cde.gateway.concepts import ConceptLabels
from cde.gateway.model_info import ModelInfo
from cde.gateway.response_schemas import DenoiseStep
from cde.shared.chunk_attribution import chunk_concepts, token_attribution
from cde.shared.config import PAGE
from cde.shared.protocol import GenerateRequest, StepResult

if TYPE_CHECKING:
    from cde.shared.tokenizer import Tokenizer


@dataclass
class StepDelta:
    index: int
    payload: DenoiseStep  # the choice object of the `step` event


class DenoiseView:
    """Per choice: turns its StepResults into StepDeltas, keeping the active block's records."""

    def __init__(
        self, index: int, req: GenerateRequest, tokenizer: Tokenizer, labels: ConceptLabels, n_known: int
    ) -> None:
        self.index, self.req, self.tokenizer = index, req, tokenizer
        self.labels, self.n_known = labels, n_known
        self.prompt_len = len(req.prompt_ids)
        # The tokens that end the answer where they land (as the worker's scheduler rules): its
        # chunk ends before the first of them, as the final attribution's does.
        ends = set(req.stop_token_ids)
        if tokenizer.eot_id is not None and not req.ignore_eos:
            ends.add(tokenizer.eot_id)
        self.ending_ids = frozenset(ends)
        self.block = -1
        self.records: list[dict] = []
        self.end = 0  # where the active block's chunk ends, absolute

    def step(self, res: StepResult) -> StepDelta:
        base = res.block * PAGE
        if res.block != self.block:
            self.block, self.records = res.block, []
            self.end = min(base + PAGE, self.prompt_len + self.req.max_tokens)
        self.end = min([self.end, *(p for p, t in zip(res.positions, res.token_ids) if t in self.ending_ids)])
        spec = self.req.attribution
        if spec is not None:
            self.records += res.attribution or []
        payload = DenoiseStep(
            index=self.index,
            block=res.block - self.prompt_len // PAGE,
            block_offset=base - self.prompt_len,
            step=res.step,
            offsets=[p - self.prompt_len for p in res.positions],
            token_ids=res.token_ids,
            tokens=[self.tokenizer.decode([t]) for t in res.token_ids],
            attribution=None if spec is None else self._attribution(res, base, spec.top_k, spec.per_token),
        )
        return StepDelta(self.index, payload)

    def _attribution(self, res: StepResult, base: int, top_k: int, per_token: bool) -> StepAttribution:
        start, end = max(base, self.prompt_len), self.end
        concepts, eps_pct = chunk_concepts(self.records, start, end, self.labels.labels, self.n_known, top_k)
        out: StepAttribution = {
            "chunk": {
                "start": start - self.prompt_len,
                "end": end - self.prompt_len,
                "concepts": cast(list[ConceptContribution], concepts),  # shared/ builds plain dicts
                "epsilon_pct": eps_pct,
            }
        }
        if per_token:
            out["tokens"] = [
                cast(
                    TokenAttribution,
                    token_attribution(
                        r, self.tokenizer.decode, self.labels.labels, self.n_known, top_k, self.prompt_len
                    ),
                )
                for r in res.attribution or []
            ]
        return out


def denoise_views(
    reqs: list[GenerateRequest], tokenizer: Tokenizer, labels: ConceptLabels, info: ModelInfo
) -> list[DenoiseView | None]:
    return [
        DenoiseView(i, r, tokenizer, labels, info.n_concepts) if r.stream_denoise else None for i, r in enumerate(reqs)
    ]
