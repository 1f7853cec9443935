"""Bounds on what one generation request may carry: each rule is defined here once. The
gateway's schemas state them (a 400 naming the field); the worker re-checks every
GenerateRequest that reaches its socket (shared/request_bounds.py), since a peer on the worker
port need not be our gateway; the CLI's flags use the same numbers. Lists are bounded by what the
model can use, so that no request costs more to encode, send or check than the model could ever
act on. tests/shared/test_limits_single_source.py fails when one of these numbers is written out
again elsewhere."""

from __future__ import annotations

from cde.shared.config import MASK_ID, PAGE
from cde.shared.protocol import FlashBlockSpec

MAX_STOPS = 16
MAX_STOP_CHARS = 1000  # a stop string longer than this is not a stop, it is a payload
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_CHARS = 256
MAX_CLIENT_CHARS = 128  # GenerateRequest.client: a digest of an API key or a client address
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it
MAX_PENALTY = 2.0  # frequency_penalty and presence_penalty: OpenAI's range [-2, 2]
# Integers go to the worker as msgpack (64-bit) and into int64 tensors: bound them well inside.
INT_MAX = (1 << 31) - 1
# A seed is any 64-bit integer, signed or not (the worker folds it to its sampler's 32-bit key:
# worker/sampler.sampling_key).
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
MAX_TEMPERATURE = 2.0
# Alternatives per generated token (OpenAI's bounds): chat top_logprobs, completions logprobs.
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_TOKENS_PER_STEP = PAGE  # a block's positions
MAX_ATTRIBUTION_TOP_K = 128
MAX_INPUT_ATTRIBUTION_STEPS = 64
MAX_INPUT_ATTRIBUTION_TOP_K = 256
# Input attribution's total work: IG steps x generated tokens x (prompt + generated tokens), the
# positions forwarded and back-propagated (an upper bound: a token's prefix is the prompt and the
# tokens before it). 2^21 is ~2.7 minutes of an H200 at 8B (20.9 s for 32 steps over one 64-token
# block after a 64-token prompt); steps 64 over 448 tokens (14.7M) would be 20 minutes.
MAX_INPUT_ATTRIBUTION_WORK = 1 << 21
# Steering strengths (in logit units when normalized) and ReLU-mask strengths: a 100-logit shift
# already saturates the softmax (e^-100 underflows float32); far larger values overflow the
# residual stream to inf/NaN and only produce degenerate text.
MAX_STEERING_STRENGTH = 100.0
# repetition_penalty: positive logits / p, negative x p. Past these (1e-40 underflows to 0 in
# float32) the logits overflow to inf and the tokens come from NaNs.
MIN_REPETITION_PENALTY = 1e-6
MAX_REPETITION_PENALTY = 1e6
# Before the model is known (schema validation), concept lists are capped at a size above any
# Steerling's known head (33,732 at 8B); the model's own n_concepts then bounds them exactly.
MAX_CONCEPT_LIST = 1 << 16
# A steering label (a concept's catalog name; names at 8B are 1-4 words) and a catalog search:
# longer text is refused before it is looked up, so the "did you mean" hint and the search index
# work on at most this many characters.
MAX_CONCEPT_LABEL_CHARS = 256
MAX_SEARCH_CHARS = 1000
# FlashBlock's knobs (tau, max_reuse): a block has PAGE positions, so neither a larger tau nor a
# larger max_reuse changes anything.
MAX_FLASHBLOCK_KNOB = PAGE
# `--kv-splits` (0: chosen per pass): a 4096-token context is 64 pages, and more shares than pages
# would stay empty.
MAX_KV_SPLITS = 64

# The API's own bounds (gateway/schemas.py, gateway/structured_schemas.py): what one HTTP body may
# ask for before any of it reaches a worker.
MAX_CHOICES = 64  # choices (prompts x n) of one request: one body must not flood the workers' queues
MAX_N = 16  # n and best_of
MAX_TOOLS = 128  # tools offered in one chat request
MAX_TOOL_CALL_ID_CHARS = 256
MAX_STRUCTURED_CHOICES = 256  # structured_outputs.choice: the strings the output may be
MAX_NAME_CHARS = 64  # OpenAI's rule for schema and function names
# OpenAI's bounds on metadata: 16 pairs, keys of 64 and values of 512 characters.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class LimitError(ValueError):
    """A request outside what the served model accepts. The gateway answers it with a 400 naming
    `param` (with `code`, when OpenAI has one); the worker refuses the request with its message."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def check_context(
    prompt_len: int,
    max_tokens: int,
    context_len: int,
    prompt_param: str = "prompt",
    max_tokens_param: str = "max_tokens",
) -> None:
    """The prompt and the tokens to generate must fit the model's context. The error names the
    field to change: the prompt when it alone fills the context, else `max_tokens_param`."""
    if prompt_len + max_tokens > context_len:
        start = f"This model's maximum context length is {context_len} tokens; the prompt ({prompt_len} tokens)"
        if prompt_len >= context_len:  # the prompt alone: max_tokens (perhaps not sent) is beside the point
            room = ", leaving no room to generate" if prompt_len == context_len else ""
            raise LimitError(
                f"{start} {'fills' if room else 'exceeds'} the context{room}. Shorten the prompt.",
                prompt_param,
                "context_length_exceeded",
            )
        raise LimitError(
            f"{start} + {max_tokens_param} ({max_tokens}) exceeds the context. Shorten the prompt or lower "
            f"{max_tokens_param}.",
            max_tokens_param,
            "context_length_exceeded",
        )


def check_input_attribution_work(steps: int, prompt_len: int, max_tokens: int, param: str) -> None:
    work = steps * max_tokens * (prompt_len + max_tokens)
    if work > MAX_INPUT_ATTRIBUTION_WORK:
        raise LimitError(
            f"input attribution of {max_tokens} tokens after a {prompt_len}-token prompt at {steps} steps is "
            f"{work:,} units of work (steps x tokens x (prompt + tokens)); the limit is "
            f"{MAX_INPUT_ATTRIBUTION_WORK:,}: lower steps or max_tokens, or shorten the prompt",
            param,
        )


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """Every id must be in the model's vocabulary. Walks the whole list: check the context first."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise LimitError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param)


def check_prompt_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """A prompt's ids: in the vocabulary, and no <|mask|>. The official generator never unmasks a
    prompt position and re-reads the whole sequence every step, so a mask there is re-steered and
    re-attended each step; with cached prompt pages no engine can honour that, so it is refused."""
    check_token_ids(ids, vocab_size, param)
    if MASK_ID in ids:
        raise LimitError(
            f"token id {MASK_ID} (<|mask|>) at prompt position {ids.index(MASK_ID)}: the model writes masked "
            "positions itself and a prompt may not hold one",
            param,
        )


def check_flashblock(spec: FlashBlockSpec) -> None:
    """FlashBlock's two knobs may not be negative: the rule of the worker (every request) and of
    `cde serve/worker --flashblock-*`; the API's schema states it as ge=0."""
    if not (spec.tau >= 0 and spec.max_reuse >= 0):
        raise LimitError("flashblock tau and max_reuse must be >= 0", "flashblock")


def clip(text: str, limit: int) -> str:
    """Text that may quote a peer or a client, cut for an error message or a log line."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


# A constrained request's grammar on the wire (shared/grammar.py bounds its compile and mask work).
MAX_GRAMMAR_CHARS = 64 << 10
