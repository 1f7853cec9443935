"""worker/constraint.py: a grammar whose token masks cost the engine thread more than their bound
fails its own request, at the first such mask, while the others run on."""

import torch
from cde.shared.config import BASE_VOCAB
from cde.shared.grammar import MASK_CPU_BUDGET_S, grammar_error, json_schema_grammar, ll_tokenizer
from cde.shared.protocol import BlockResult, GenerateRequest
from cde.worker.engine import Engine, EngineArgs

# Cheap masks for `{"b":1,` (the gateway's first-mask check passes it), then ~140 ms each: a
# 20,000-character const escapes llguidance's fuel.
SLOW_LATER = {
    "type": "object",
    "properties": {"b": {"enum": [1, 2]}, "a": {"const": "a" * 20_000}},
    "required": ["b", "a"],
}


def test_a_grammar_with_slow_masks_fails_alone(tiny_dir):
    engine = Engine(EngineArgs(str(tiny_dir), max_running=2))
    engine.add_request(GenerateRequest("slow", [1, 2, 3], max_tokens=64, grammar=json_schema_grammar(SLOW_LATER)))
    engine.add_request(GenerateRequest("plain", [1, 2, 3], max_tokens=16))
    ends, tokens = {}, {"slow": 0, "plain": 0}  # tokens sent in blocks
    while engine.has_work():
        for res in engine.step():
            if isinstance(res, BlockResult):
                tokens[res.request_id] += len(res.token_ids)
                if res.finished:
                    ends[res.request_id] = res
    assert ends["slow"].finish_reason == "error" and "token mask" in ends["slow"].error, ends["slow"]
    assert f"over the {MASK_CPU_BUDGET_S * 1e3:.0f} ms bound" in ends["slow"].error
    # the gateway's check of the first mask passes it: only the worker's bound catches it
    assert grammar_error(json_schema_grammar(SLOW_LATER), ll_tokenizer(False, BASE_VOCAB)) == ""
    assert ends["plain"].finish_reason == "length" and tokens["plain"] == 16


def test_a_refused_pick_names_a_dead_end_only_when_it_is_one():
    """After "a", `x: x "b"` allows no token (llguidance's NoExtensionBias): the dead end the
    gateway answers as the request's fault. Any other matcher error is passed on as it is."""
    from cde.shared.grammar import lark_grammar
    from cde.shared.protocol import GRAMMAR_DEAD_END
    from cde.shared.tokenizer import get_tokenizer
    from cde.worker.constraint import Constraint

    enc = get_tokenizer(False).enc
    dead = Constraint(lark_grammar('start: "a" x\nx: x "b"'), False, BASE_VOCAB)
    assert dead.accept(enc.encode("a")) == 1
    dead.fill(torch.zeros(-(-BASE_VOCAB // 32), dtype=torch.int32))
    assert dead.refusal() == GRAMMAR_DEAD_END
    other = Constraint(lark_grammar('start: "a"'), False, BASE_VOCAB)
    assert not other.matcher.consume_tokens(enc.encode("zz"))
    assert other.refusal().startswith("grammar: Parser Error") and other.refusal() != GRAMMAR_DEAD_END


def test_a_step_over_the_grammars_limits_is_its_fault(monkeypatch):
    """Mid-answer, a step over llguidance's per-token limits (here few parser items, so that a
    small schema reaches them) is the grammar's work, as a mask over its CPU bound: the gateway
    answers it as the request's fault, never a 500 a client retries."""
    import cde.shared.grammar
    from cde.shared.protocol import grammar_fault
    from cde.shared.tokenizer import get_tokenizer
    from cde.worker.constraint import Constraint
    from llguidance import LLParserLimits

    monkeypatch.setattr(cde.shared.grammar, "limits", lambda: LLParserLimits(step_max_items=60))
    keys = {f"k{i}": {"type": "string"} for i in range(30)}
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "object", "properties": keys}}}}
    con = Constraint(json_schema_grammar(schema), False, BASE_VOCAB)
    row = torch.zeros(-(-BASE_VOCAB // 32), dtype=torch.int32)
    for token in get_tokenizer(False).encode('{"a":[{"k1":"x"},'):
        con.fill(row)
        if not con.accept([token]):
            break
    assert "Too many items" in con.refusal() and grammar_fault(con.refusal()) == "grammar_too_slow"
