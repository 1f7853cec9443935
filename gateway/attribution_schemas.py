"""The `attribution` object of a choice, and of a `stream_denoise` step, as the response schemas
(gateway/response_schemas.py) describe it. TypedDicts, not models: shared/chunk_attribution.py
and gateway/input_attribution_render.py build these as plain dicts (numpy over the packed arrays, also
for `cde generate` and training), so a response keeps them as they are. Unknown keys are refused
(`extra="forbid"`): a key the renderers add without a line here fails the tests, not the client."""

from __future__ import annotations

from typing import Literal, NotRequired

from pydantic import ConfigDict, with_config
from typing_extensions import TypedDict

_CLOSED = ConfigDict(extra="forbid")


@with_config(_CLOSED)
class ConceptContribution(TypedDict):
    """A concept's share of a chunk: its normalised contributions averaged over the chunk."""

    id: int  # in its head: known ids and discovered ids both count from 0
    type: Literal["known", "discovered"]
    label: str  # the catalog's name, or `Known: #id` / `Discovered: #id`
    contribution: float


@with_config(_CLOSED)
class TokenConcept(ConceptContribution):
    """A concept's contribution to one token's logit: sigmoid(logit_i) * (E_i . W_y)."""

    weight: float  # sigmoid of the concept's logit


@with_config(_CLOSED)
class InputContribution(TypedDict):
    """An input position's integrated-gradients contribution to one generated token's logit."""

    position: int  # from the start of the prompt
    token_id: int
    text: str
    contribution: float


@with_config(_CLOSED)
class InputScore(TypedDict):
    """An input position's score over a chunk: the official `aggregate_chunk` (mean, signed)."""

    position: int
    token_id: int
    text: str
    score: float


@with_config(_CLOSED)
class ConceptChunk(TypedDict):
    """A chunk of the completion (a 64-token block, or `<|endofchunk|>`-delimited)."""

    start: int  # offsets in the completion's tokens, end exclusive
    end: int
    text: str
    concepts: list[ConceptContribution]
    # the residual's share of the chunk's mass, in percent; null for a chunk without a committed token
    epsilon_pct: float | None
    inputs: NotRequired[list[InputScore]]  # with input attribution


@with_config(_CLOSED)
class TokenAttribution(TypedDict):
    """One generated token's own concepts (`per_token: true`)."""

    offset: int  # in the completion
    token_id: int
    text: str
    target_logit: float
    epsilon: float
    concepts: list[TokenConcept]


@with_config(_CLOSED)
class InputToken(TypedDict):
    offset: int
    token_id: int
    text: str
    inputs: list[InputContribution]  # top_k by |contribution|


@with_config(_CLOSED)
class InputChunk(TypedDict):
    start: int
    end: int
    inputs: list[InputScore]


@with_config(_CLOSED)
class InputAttribution(TypedDict):
    """Which input tokens caused each generated token (`attribution.inputs`)."""

    tokens: list[InputToken]
    chunks: list[InputChunk]


@with_config(_CLOSED)
class Attribution(TypedDict):
    """A choice's attribution. The finish event and a whole response carry `chunks` (and `tokens`
    with `per_token`); a streamed block's own event carries only that block's `inputs`."""

    chunks: NotRequired[list[ConceptChunk]]
    tokens: NotRequired[list[TokenAttribution]]
    inputs: NotRequired[InputAttribution]


@with_config(_CLOSED)
class RunningChunk(TypedDict):
    """The concepts of the block being denoised, over the tokens committed so far."""

    start: int
    end: int
    concepts: list[ConceptContribution]
    epsilon_pct: float | None


@with_config(_CLOSED)
class StepAttribution(TypedDict):
    chunk: RunningChunk
    tokens: NotRequired[list[TokenAttribution]]  # the step's new tokens, with `per_token`
