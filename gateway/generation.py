"""The choices of one API request in flight: block results (and, for token streaming, the
committed prefixes of each block) in, client text deltas out (streamed interleaved by choice
index, or collected), with latency and token metrics on the way. Choices that asked for
`stream_denoise` also yield a StepDelta per denoising step."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from cde.gateway.attribution_schemas import Attribution, InputAttribution
from cde.gateway.denoise import DenoiseView, StepDelta
from cde.gateway.detokenizer import ChoiceText
from cde.gateway.errors import ApiError, GenerationError
from cde.gateway.input_attribution_render import attach, render_block
from cde.gateway.metrics import Metrics
from cde.gateway.response_schemas import FinishReason
from cde.gateway.router import Router
from cde.gateway.worker_link import RequestHandle
from cde.shared.packed_attribution import PackedAttribution
from cde.shared.protocol import BlockResult, GenerateRequest, PrefixResult, StepResult, TokenLogprobs
from cde.shared.wire import WireError, encode_all

if TYPE_CHECKING:
    from cde.gateway.attribution_render import Render
    from cde.shared.tokenizer import Tokenizer


# Per token, when asked: (logprob, top ids, top logprobs), shared/protocol.TokenLogprobs row by row.
TokenLogprob = tuple[float, list[int], list[float]]


@dataclass
class Delta:
    index: int
    text: str
    token_ids: list[int]  # the tokens this delta's text counts (usage.completion_tokens)
    finish_reason: FinishReason | None = None
    attribution: Attribution | None = None  # on the finish delta, when the request asked
    logprobs: list[TokenLogprob] | None = None  # of token_ids, when the request asked


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    attribution: Attribution | None = None
    logprobs: list[TokenLogprob] | None = None


# Above this many list entries (prompt ids, concepts, mask keys), a request's choices are
# encoded on a thread: the event loop keeps reading heartbeats and serving other clients.
LARGE_REQUEST_ITEMS = 20_000


async def encode_requests(reqs: list[GenerateRequest]) -> list[bytes]:
    """The choices of one API request as wire frames: what they share packed once, and off the
    event loop when large. 413 for a request over the frame limit."""
    steering = reqs[0].steering  # one object for every choice
    items = sum(len(r.prompt_ids) for r in reqs)
    items += len(steering.concepts) + len(steering.relu_logit_mask) if steering else 0
    try:
        if items < LARGE_REQUEST_ITEMS:
            return encode_all(reqs)
        return await asyncio.to_thread(encode_all, reqs)
    except WireError as exc:
        raise ApiError(413, f"the request does not fit the worker link: {exc}", None, "request_too_large") from None


class Generation:
    def __init__(
        self,
        router: Router,
        metrics: Metrics,
        reqs: list[GenerateRequest],
        frames: list[bytes],
        tokenizer: Tokenizer,
        stops: list[str],
        include_stop: bool,
        render_attribution: Render,
        denoise_views: list[DenoiseView | None],
        grammar_param: str | None = None,
    ) -> None:
        self.metrics = metrics
        self._render = render_attribution
        self._decode = tokenizer.decode
        self._views = denoise_views
        self._reqs = reqs
        self._grammar_param = grammar_param  # the field a grammar's dead end is blamed on
        self.started = time.monotonic()
        self.completion_tokens = 0
        self._cached = [0] * len(reqs)  # per choice: prompt tokens its worker found cached
        self._texts = [ChoiceText(tokenizer, stops, include_stop) for _ in reqs]
        self._handles: list[RequestHandle] = []
        try:
            for req, frame in zip(reqs, frames):
                self._handles.append(router.submit(req, frame))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Abort whatever is still generating (client gone, error, shutdown); idempotent."""
        for handle in self._handles:
            handle.abort()

    def cached_tokens(self, choices_per_prompt: int) -> int:
        """usage.prompt_tokens_details.cached_tokens: like prompt_tokens, each prompt counts once,
        with what all of its choices found cached (the n choices of one prompt share its pages,
        so only the first to be admitted prefills them: that prompt was computed once)."""
        c, n = self._cached, choices_per_prompt
        return sum(min(c[i : i + n]) for i in range(0, len(c), n))

    async def _choice(self, index: int) -> AsyncIterator[Delta | StepDelta]:
        handle, text, m, view = self._handles[index], self._texts[index], self.metrics, self._views[index]
        # A stop found in a block's committed prefix ends the choice at once, unless the finish
        # event must still carry the block's attribution (which comes with the BlockResult).
        stop_early = self._reqs[index].attribution is None
        logprobs: list[TokenLogprob] | None = [] if self._reqs[index].logprobs is not None else None
        last = None
        block_fed = 0  # tokens of the active block already fed from PrefixResults
        given = 0  # tokens of `text.ids` handed out in deltas
        eot_at: int | None = None  # where <|eot_id|> ended the generation (BlockResult.end_position)
        blocks: list[PackedAttribution] = []  # the attribution of each block, when asked
        inputs: list[InputAttribution] = []  # the input attribution of each block, when asked
        try:
            async for res in handle.results():
                if isinstance(res, StepResult):  # only sent for requests with a view
                    yield view.step(res)
                    continue
                block_inputs: Attribution | None = None
                self._cached[index] = res.cached_tokens
                if isinstance(res, PrefixResult):
                    new, skip, final = res.token_ids, 0, False
                    block_fed += len(new)
                else:
                    if res.finish_reason == "error":  # no block: no latency sample, a failure counted
                        m.finished.labels("error").inc()
                        raise GenerationError(res.error or "generation failed", self._grammar_param)
                    now = time.monotonic()
                    (m.ttfb if last is None else m.inter_block).observe(now - (last or self.started))
                    last = now
                    if res.attribution is not None:
                        blocks.append(res.attribution)
                    eot_at = res.end_position
                    if res.input_attribution is not None:  # in the block's own event
                        inputs.append(render_block(res.input_attribution, res.prompt_tokens, self._decode))
                        block_inputs = {"inputs": inputs[-1]}
                    # The block repeats its prefix already fed (a stop may have cut it shorter).
                    new, skip, final = res.token_ids[block_fed:], block_fed, res.finished
                    block_fed = 0
                if logprobs is not None and res.logprobs is not None:
                    logprobs += _rows(res.logprobs, skip, skip + len(new))
                piece = text.add(new, final=final)
                released = text.ids[given : text.released]
                given = text.released
                self.completion_tokens += len(released)
                m.generation_tokens.inc(len(released))
                if piece or released or block_inputs is not None or not self._reqs[index].stream_tokens:
                    lps = None if logprobs is None else logprobs[given - len(released) : given]
                    yield Delta(index, piece, released, attribution=block_inputs, logprobs=lps)
                reason: FinishReason | None
                if isinstance(res, BlockResult):
                    # The worker's reasons past "error" (raised above): length, stop, abort.
                    worker_reason = cast(FinishReason, res.finish_reason) if res.finished else None
                    reason = "stop" if text.stopped else worker_reason
                else:
                    reason = "stop" if text.stopped and stop_early else None
                if reason is not None:
                    # Its own event, like OpenAI's final chunk: empty text, the finish_reason.
                    # A stop string that cut the text ends it there instead.
                    attribution = self._render(index, blocks, given, None if text.stopped else eot_at)
                    yield Delta(index, "", [], reason, attach(attribution, inputs) if inputs else attribution)
                    m.e2e.observe(time.monotonic() - self.started)
                    m.finished.labels(reason).inc()
                    return
        finally:
            handle.abort()

    async def stream(self) -> AsyncIterator[Delta | StepDelta]:
        """Deltas of all choices as they come; each choice ends with exactly one finish_reason."""
        queue: asyncio.Queue[Delta | StepDelta | BaseException] = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for delta in self._choice(index):
                    queue.put_nowait(delta)
            except Exception as exc:
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self._handles))]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Delta) and item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            for t in tasks:
                t.cancel()
            self.close()

    async def collect(self) -> list[Choice]:
        """The whole choices (requests with stream_denoise are streamed: the gateway refuses
        stream_denoise without stream)."""
        choices = [Choice(i) for i in range(len(self._handles))]
        async for d in self.stream():
            c = choices[d.index]
            c.text += d.text
            c.token_ids += d.token_ids
            c.finish_reason = d.finish_reason or c.finish_reason
            c.attribution = d.attribution or c.attribution
            if d.logprobs is not None:
                c.logprobs = (c.logprobs or []) + d.logprobs
        return choices


def _rows(lp: TokenLogprobs, start: int, end: int) -> list[TokenLogprob]:
    return list(zip(lp.logprobs[start:end], lp.top_ids[start:end], lp.top_logprobs[start:end]))
