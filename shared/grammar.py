"""Grammars of constrained decoding, as the gateway and the worker both build and bound them.

A constrained request carries an llguidance grammar (a JSON schema in llguidance's JSON
serialization, or a Lark grammar that may embed JSON schemas). The gateway compiles it once to refuse a bad one with a
400; the worker builds its matcher from the same text under the same limits. The limits bound
what one request's grammar can cost: its size on the wire, the work of building its lexer, and
the work of each token mask (llguidance's fuel counters; see docs/security.md).
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

from cde.shared.config import EOS_ID, EOT_ID
from cde.shared.limits import MAX_GRAMMAR_CHARS
from cde.shared.schema_finite import check_finite
from cde.shared.tokenizer import get_tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.tiktoken import lltokenizer_from_encoding

MAX_SCHEMA_CHARS = 32 << 10  # a response_format schema or a tools list, as JSON text
# Building the lexer: ~50k fuel/ms, so 20 ms; each mask: ~14k/ms lexer + ~20k items/ms parser, so
# ~17 ms at worst (a plain JSON schema takes ~0.1 ms); lexer states ~1-2 kB each: <= 100 MB.
INITIAL_LEXER_FUEL, STEP_LEXER_FUEL, STEP_MAX_ITEMS = 1_000_000, 200_000, 50_000
# A long literal escapes the fuel: each mask over a 20,000-character `const` costs ~140 ms of CPU,
# a mask per pass of the worker. Past this CPU time a mask's grammar is refused (at the gateway,
# its first mask) or its request failed (in the worker, any mask).
MASK_CPU_BUDGET_S = 0.05
MAX_LEXER_STATES, MAX_GRAMMAR_SIZE = 50_000, 100_000
# Compact JSON ("," and ":" without spaces, no free whitespace): a model cannot spend its tokens on
# blank space, and the end of the value ends the grammar.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
# A schema that asks for no exactness (a tool without `strict`, a response_format without
# `strict: true`): keywords and formats llguidance does not implement (uniqueItems, format "path",
# not, if/then) are left unenforced, as OpenAI leaves non-strict schemas and the JSON Schema spec
# unknown formats, instead of refusing the request; every keyword it implements still holds.
LENIENT_JSON_OPTIONS: JsonCompileOptions = {**JSON_OPTIONS, "lenient": True}


def limits() -> LLParserLimits:
    return LLParserLimits(
        initial_lexer_fuel=INITIAL_LEXER_FUEL,
        step_lexer_fuel=STEP_LEXER_FUEL,
        step_max_items=STEP_MAX_ITEMS,
        max_lexer_states=MAX_LEXER_STATES,
        max_grammar_size=MAX_GRAMMAR_SIZE,
    )


@functools.cache
def ll_tokenizer(instruct: bool, vocab_size: int) -> LLTokenizer:
    """The model's tokenizer for llguidance (about 0.7 s and a few tens of MB, once per process).
    A sequence ends with <|eot_id|> on instruct models; base models end when the grammar does."""
    tok = get_tokenizer(instruct)
    return lltokenizer_from_encoding(tok.enc, n_vocab=vocab_size, eos_token=EOT_ID if instruct else EOS_ID)


def json_options(strict: bool) -> JsonCompileOptions:
    """`strict`: a keyword llguidance does not implement is refused, else left unenforced."""
    return JSON_OPTIONS if strict else LENIENT_JSON_OPTIONS


def json_schema_grammar(schema: dict[str, Any], strict: bool = True) -> str:
    """ValueError for a schema llguidance refuses (under `json_options(strict)`), or one with a
    part no finite value fits (shared/schema_finite.py)."""
    check_finite(schema)
    return LLMatcher.grammar_from_json_schema(closed_objects(schema), defaults=json_options(strict))


# Keywords whose value is a schema, a list of schemas, or a map of names to schemas. allOf, not and
# if are left out: closing their members would change what the whole accepts.
_SCHEMA, _SCHEMAS = (
    frozenset({"items", "additionalProperties", "then", "else", "contains"}),
    frozenset({"anyOf", "oneOf", "prefixItems"}),
)
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
_OPENING = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """`schema` with every object schema that lists its properties and says nothing of others
    closed to them (`additionalProperties: false`), as xgrammar's strict mode reads it (the
    default of vLLM and SGLang): otherwise a model may write keys nobody declared until its
    tokens run out. Values that are data (const, enum, default, examples) are left alone."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA:
            out[key] = closed_objects(value)
        elif key in _SCHEMAS and isinstance(value, list):
            out[key] = [closed_objects(v) for v in value]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(v) for name, v in value.items()}
        else:
            out[key] = value
    if "properties" in out and not any(key in out for key in _OPENING):
        out["additionalProperties"] = False
    return out


def lark_grammar(lark: str) -> str:
    return LLMatcher.grammar_from_lark(lark)


def grammar_error(grammar: str, tokenizer: LLTokenizer) -> str:
    """Why the grammar cannot be used ("" when it can): too large, invalid, over the limits, or
    admitting no output at all (`start: x  x: x "a"` validates; its first mask shows the dead end)."""
    try:
        matcher = new_matcher(grammar, tokenizer)
    except ValueError as exc:
        return str(exc).removeprefix("grammar: ")
    started = time.thread_time()
    matcher.compute_logit_bias()
    if matcher.is_error():
        return "the grammar admits no output: no token can start it"
    return slow_mask_error(time.thread_time() - started)


def slow_mask_error(cpu_s: float) -> str:
    """Why a grammar whose token mask took `cpu_s` of CPU cannot be used ("" within the budget)."""
    if cpu_s <= MASK_CPU_BUDGET_S:
        return ""
    return (
        f"a token mask of this grammar takes {cpu_s * 1e3:.0f} ms, over the {MASK_CPU_BUDGET_S * 1e3:.0f} ms "
        "bound (a literal, const or repeated regex of thousands of characters?)"
    )


def new_matcher(grammar: str, tokenizer: LLTokenizer) -> LLMatcher:
    """A matcher at the start of the grammar; ValueError for one that cannot be used."""
    error = (
        f"the grammar is {len(grammar)} characters, more than {MAX_GRAMMAR_CHARS}"
        if len(grammar) > MAX_GRAMMAR_CHARS
        else LLMatcher.validate_grammar(grammar, tokenizer, limits=limits())
    )
    if error:
        raise ValueError(f"grammar: {error}")
    matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=limits())
    if matcher.is_error():
        raise ValueError(f"grammar: {matcher.get_error()}")
    return matcher
