"""Typed messages between gateway and worker.

Each message is a dataclass; on the wire it is a msgpack map `{"type": <tag>, ...fields}` (never
pickle). The engine consumes `GenerateRequest` directly and produces `BlockResult`s (plus
`StepResult`s for requests that stream the denoising), so the same types serve the offline
engine, `cde generate` and the ZeroMQ worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cde.shared.packed_attribution import PackedAttribution

# 2: StepResult, GenerateRequest.flashblock, Heartbeat.rss_bytes; 3: PackedAttribution; 4: Heartbeat.context_len;
# 5: GenerateRequest.client, Heartbeat.refused_frames
# 6: Heartbeat.catalog_digest/catalog_bytes, CatalogQuery, CatalogPart
# 7: PrefixResult, GenerateRequest.stream_tokens and .logprobs, TokenLogprobs
# 8: GenerateRequest's logit rules (penalties, logit_bias, min_tokens, ignore_eos)
# 9: GenerateRequest.grammar
# 10: BlockResult.cached_tokens, Heartbeat's prefix cache figures
# 11: Heartbeat.device_idle_ms
# 12: PrefixResult.cached_tokens
# 13: BlockResult.end_position; 14: GenerateRequest.include_stop_str_in_output
# 15: Heartbeat.engine_beats
PROTOCOL_VERSION = 15


@dataclass
class SteeringSpec:
    concepts: list[int]
    strength: float = 8.0
    normalize: bool = True
    inject_layer: int = 8
    schedule: str = "hard_cutoff"  # "fixed" | "hard_cutoff"
    cutoff_tokens: int = 32
    relu_logit_mask: dict[int, float] = field(default_factory=dict)


@dataclass
class InputAttributionSpec:
    """Input attribution: integrated gradients over the snapshot each token was committed from."""

    top_k: int = 10
    steps: int = 8  # interpolation steps, 1-64
    scope: str = "prompt"  # "prompt" | "all" (the prompt and the generated tokens the model saw)


@dataclass
class AttributionSpec:
    top_k: int = 10
    per_token: bool = False
    chunking: str = "block"  # "block" | "endofchunk"
    inputs: InputAttributionSpec | None = None


@dataclass
class FlashBlockSpec:
    """Reuse of the active block's attention to the cached pages across denoising steps
    (FlashBlock). The cached part is recomputed at a block's first step, after a step that
    unmasked at least `tau` tokens, and after `max_reuse` reuses in a row."""

    tau: int = 2
    max_reuse: int = 16


@dataclass
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    entropy_sampling: bool = False
    repetition_penalty: float = 1.0
    seed: int | None = None
    tokens_per_step: int = 1
    confidence_threshold: float | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # vLLM's: the completion keeps the stop string (its tokens count: input attribution covers them)
    include_stop_str_in_output: bool = False
    steering: SteeringSpec | None = None
    attribution: AttributionSpec | None = None
    stream_denoise: bool = False  # also send a StepResult for every denoising step
    stream_tokens: bool = False  # also send a PrefixResult whenever the block's committed left prefix grows
    logprobs: int | None = None  # per generated token its logprob and this many top alternatives (0-20)
    # None: the worker's default; False: exact attention; a spec: FlashBlock reuse.
    flashblock: FlashBlockSpec | bool | None = None
    # Who asked (a digest of the API key, or the client's address): the worker's fair share.
    client: str = ""
    # OpenAI's penalties over the tokens this request has unmasked so far, and logit_bias
    # (token id -> added logit); min_tokens bans EOT and stop_token_ids until that many tokens
    # precede the position; ignore_eos: EOT is a plain token (worker/logit_rules.py).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    ignore_eos: bool = False
    # Constrained decoding: an llguidance grammar (shared/grammar.py), None: unconstrained.
    grammar: str | None = None


@dataclass
class StepResult:
    """What one denoising step of one request committed (only for requests with
    `stream_denoise`), sent before the BlockResult of the block it completes, if any."""

    request_id: str
    block: int  # absolute block index
    step: int  # the request's denoising steps so far, this one included
    positions: list[int]  # absolute positions, in the order they were unmasked
    token_ids: list[int]
    attribution: PackedAttribution | None = None  # of the committed tokens, when asked


@dataclass
class TokenLogprobs:
    """Per token (in the order of the result's token_ids): its logprob at the step that committed
    it, and the top alternatives at that position in that step, best first."""

    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def check(self) -> None:
        if not len(self.logprobs) == len(self.top_ids) == len(self.top_logprobs):
            raise ValueError("logprobs, top_ids and top_logprobs differ in length")
        if any(len(i) != len(v) for i, v in zip(self.top_ids, self.top_logprobs)):
            raise ValueError("a token's top_ids and top_logprobs differ in length")

    def slice(self, start: int, end: int) -> TokenLogprobs:
        return TokenLogprobs(self.logprobs[start:end], self.top_ids[start:end], self.top_logprobs[start:end])


@dataclass
class PrefixResult:
    """Tokens that just joined the committed left prefix of a request's active block (only for
    requests with `stream_tokens`): final, the next ones in the completion's order. The block's
    BlockResult later repeats them (with whatever a stop cut off)."""

    request_id: str
    token_ids: list[int]
    logprobs: TokenLogprobs | None = None  # when asked
    # The BlockResult's figure, here too: a stop string found in a prefix ends the choice before it.
    cached_tokens: int = 0


# BlockResult.error of a request whose grammar allowed no token mid-answer: it entered a part that
# never ends (a Lark rule that only recurses; JSON schemas are checked before they run).
GRAMMAR_DEAD_END = "the grammar allows no token here: the answer entered a part of it that never ends"
# How BlockResult.error begins for a request whose grammar's work for one token passed its bounds
# mid-answer: a mask past its CPU bound (a long const escapes llguidance's fuel after a cheap
# start), or a step past llguidance's own per-token limits (worker/constraint.py).
GRAMMAR_TOO_SLOW = "grammar too slow: "


def grammar_fault(error: str) -> str | None:
    """The error code of a generation error that is its grammar's fault (the gateway answers it as
    the request's fault, a 400 naming the grammar's field, never a 500 a client retries); None for
    any other error."""
    if error == GRAMMAR_DEAD_END:
        return "grammar_dead_end"
    if error.startswith(GRAMMAR_TOO_SLOW):
        return "grammar_too_slow"
    return None


@dataclass
class BlockResult:
    """One completed 64-token block of one request (or its end)."""

    request_id: str
    token_ids: list[int]  # new tokens of this block in position order
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    stop_str: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens in pages the prefix cache held (usage.prompt_tokens_details)
    attribution: PackedAttribution | None = None  # of the committed tokens, when asked
    input_attribution: InputAttribution | None = None  # of this block's tokens, when asked
    logprobs: TokenLogprobs | None = None  # of token_ids, when asked
    # Where <|eot_id|> ended the generation (absolute): the reference's last chunk ends there, its
    # never-unmasked positions before it counted (None: after the last token).
    end_position: int | None = None


# What the engine emits for a request.
EngineResult = BlockResult | StepResult | PrefixResult


@dataclass
class InputAttribution:
    """A block's input attribution (worker/input_attribution_runner.py). Positions are absolute
    (from the start of the prompt); per token its top-k inputs by |contribution|, per chunk that
    this block closes its top-k inputs by the official aggregate_chunk score."""

    positions: list[int] = field(default_factory=list)  # the block's tokens
    token_ids: list[int] = field(default_factory=list)
    top_positions: list[list[int]] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_scores: list[list[float]] = field(default_factory=list)  # signed contributions
    chunk_spans: list[list[int]] = field(default_factory=list)  # [start, end) positions
    chunk_positions: list[list[int]] = field(default_factory=list)
    chunk_token_ids: list[list[int]] = field(default_factory=list)
    chunk_scores: list[list[float]] = field(default_factory=list)


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Ping:
    """Gateway -> worker every heartbeat interval; the reply (a Heartbeat) proves liveness and
    tells a ROUTER-side worker where this gateway is, even after it reconnected."""

    sent_at: float = 0.0


@dataclass
class Heartbeat:
    """Worker -> gateway: identity, what the model accepts (so the gateway can validate without
    the checkpoint) and current load."""

    boot_id: str  # new per worker process: a change means in-flight requests were lost
    model: str
    context_len: int  # positions: prompt + generated tokens
    vocab_size: int
    instruct: bool
    n_layers: int
    n_concepts: int
    max_running: int
    running: int = 0
    waiting: int = 0
    pages_used: int = 0
    pages_free: int = 0
    steps_per_s: float = 0.0
    forward_passes: int = 0  # since the worker started
    # Of the time since, the device's waits for the host's next launch between back-to-back passes
    # (worker/device_clock.py): the host's share of a busy worker.
    device_idle_ms: float = 0.0
    # The prefix cache (worker/prefix_cache.py), since the worker started: tokens of full prompt pages
    # looked up and found, pages evicted; and the pages it holds now.
    cache_query_tokens: int = 0
    cache_hit_tokens: int = 0
    cache_evictions: int = 0
    cache_pages: int = 0
    rss_bytes: int = 0  # resident memory of the worker process (0 where /proc is missing)
    refused_frames: int = 0  # dropped unread past the worker's inbox budget (worker/inbox_budget.py)
    catalog_digest: str = ""  # sha256 of the worker's concept catalog file ("": it has none)
    catalog_bytes: int = 0  # its size: a gateway fetches it in CatalogParts
    # Heartbeats the engine thread has built: at least one each 0.1 s while its loop runs. The
    # I/O thread answers Pings on its own, so a count that stands still while Pings are answered
    # says the engine is stuck (a hung device, a step that never ends).
    engine_beats: int = 0
    protocol_version: int = PROTOCOL_VERSION


@dataclass
class ConceptQuery:
    """Gateway -> worker: the vocabulary tokens a known concept most promotes (needs the weights)."""

    query_id: str
    concept_id: int
    k: int = 15


@dataclass
class ConceptInfo:
    """Worker -> gateway: the answer to a ConceptQuery, best first, or why there is none."""

    query_id: str
    token_ids: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass
class CatalogQuery:
    """Gateway -> worker: the bytes of its concept catalog file from `offset` on (one part)."""

    offset: int = 0


@dataclass
class CatalogPart:
    """Worker -> gateway: a slice of its catalog file (`shared.catalog_file`); `suffix` says how
    to read the whole (".parquet" or ".csv"); empty `data` past the end or for a bad offset."""

    digest: str
    offset: int
    total: int
    suffix: str
    data: bytes = b""
