"""Replies from an Engine in this process to requests already built (cde.shared.protocol's
GenerateRequest), with no HTTP layer in between: the step loop under the training log's held-out
accuracy (`greedy_chat`, requests straight from the tokenizer's chat prompt) and under `cde
eval`'s engine backend (cde/eval/backends.py, whose requests the gateway's own parsing builds).
A request's denoising steps are counted from its StepResults (stream_denoise), as the HTTP side
counts its `step` events, so tokens per forward pass mean the same thing on either side."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cde.shared.protocol import BlockResult, GenerateRequest, StepResult

if TYPE_CHECKING:
    from cde.shared.packed_attribution import PackedAttribution
    from cde.worker.engine import Engine


@dataclass
class Completion:
    text: str
    tokens: int  # committed tokens, the closing <|eot_id|> included
    steps: int  # denoising steps (forward passes that committed tokens for this request)
    attribution: list[dict] | None = None  # the API's attribution chunks (cde eval), when asked


@dataclass
class Batch:
    completions: list[Completion]
    seconds: float


@dataclass
class Replies:
    """Per request, in the order given: its committed token ids, tokens and denoising steps
    counted from its StepResults, its blocks' concept attribution (when asked), where EOT ended it
    (BlockResult.end_position); and the batch's wall time."""

    token_ids: list[list[int]]
    tokens: list[int]
    steps: list[int]
    attribution: list[list[PackedAttribution]]
    end_position: list[int | None]
    seconds: float


def run(engine: Engine, reqs: list[GenerateRequest]) -> Replies:
    """Every request to its end on `engine`; each must stream its denoising (stream_denoise)."""
    index = {r.request_id: i for i, r in enumerate(reqs)}
    out = Replies([[] for _ in reqs], [0] * len(reqs), [0] * len(reqs), [[] for _ in reqs], [None] * len(reqs), 0.0)
    start = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        for res in engine.step():
            i = index[res.request_id]
            if isinstance(res, StepResult):
                out.steps[i] += 1
                out.tokens[i] += len(res.token_ids)
            elif isinstance(res, BlockResult):
                out.token_ids[i] += res.token_ids
                out.end_position[i] = res.end_position
                if res.attribution is not None:
                    out.attribution[i].append(res.attribution)
    out.seconds = time.perf_counter() - start
    return out


def greedy_chat(engine: Engine, conversations: list[list[dict]], max_tokens: int) -> Batch:
    """Each conversation through the tokenizer's chat template, decoded greedily one token per
    step (the engine's defaults, as an API request that sets only temperature 0 gets them)."""
    tok = engine.tokenizer
    reqs = [
        GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt_ids=tok.chat_prompt(messages),
            max_tokens=max_tokens,
            temperature=0.0,
            stream_denoise=True,
        )
        for messages in conversations
    ]
    r = run(engine, reqs)
    return Batch([Completion(tok.decode(r.token_ids[i]), r.tokens[i], r.steps[i]) for i in range(len(reqs))], r.seconds)
