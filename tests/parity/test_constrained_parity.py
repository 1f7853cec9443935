"""Constrained decoding against the official model: every token a constrained request commits is
what the commit rule (worker/constraint.py) makes of the official model's (steered) logits at that
step, masked by an independent llguidance matcher.

Greedy, one 64-token block after a 64-token prompt, so every step's state is the prompt, the
tokens committed by earlier steps and masks (the requests stream their steps to say which). Per
step: the first pick is the leftmost masked position and the argmax of the official logits under
the grammar's bitmask; each further pick (tokens_per_step > 1) is the next position and the
unconstrained argmax, kept only while the grammar accepts it; the step stops at the first draft
the grammar refuses."""

import json

import numpy as np
import pytest
import torch
from cde.shared.config import EOS_ID, MASK_ID
from cde.shared.grammar import json_schema_grammar, ll_tokenizer
from cde.shared.protocol import GenerateRequest, StepResult
from cde.worker.engine import Engine, EngineArgs
from llguidance import LLMatcher

from tests.parity.test_steering_parity import amplify

pytestmark = pytest.mark.reference

N_NEW = 64
SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 12},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "flag": {"type": "boolean"},
    },
    "required": ["word", "n", "flag"],
    "additionalProperties": False,
}


def allowed(matcher: LLMatcher, vocab: int) -> torch.Tensor:
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
    bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return torch.from_numpy(bits.reshape(-1)[:vocab].astype(bool))


def official_step_logits(gen, x: list[int], steering) -> torch.Tensor:
    """The official generator's logits [T, V] for the sequence state x, steered as its generate_full does."""
    ids = torch.tensor([x])
    alpha, direction, layer = 0.0, None, None
    if steering is not None:
        direction, base, layer = gen._prepare_steering(steering)
        masked = int((ids == MASK_ID).sum())
        alpha = gen._resolve_alpha(steering.inject_alpha_schedule, base, masked, N_NEW, steering.cutoff_tokens)
    direction = direction if alpha != 0.0 else None
    logits = gen._forward(ids, gen._position_injection(ids, direction), layer, alpha)[0].float()
    logits[:, EOS_ID] = float("-inf")
    logits[:, [MASK_ID, gen.tokenizer.pad_token_id]] = float("-inf")
    return logits


def run_steps(engine: Engine, req: GenerateRequest) -> list[StepResult]:
    engine.add_request(req)
    steps = []
    while engine.has_work():
        steps += [r for r in engine.step() if isinstance(r, StepResult)]
    return steps


@pytest.mark.parametrize("tokens_per_step", [1, 4])
def test_constrained_steered_picks_follow_the_official_logits(tiny_dir, tokens_per_step):
    from tests.oracle import official_generator

    gen = official_generator(tiny_dir)
    vocab = gen.model.transformer.lm_head.weight.shape[0]
    ours, ref = amplify([3, 17, 40], 1)
    prompt = torch.randint(0, 100000, (64,), generator=torch.Generator().manual_seed(11)).tolist()
    grammar = json_schema_grammar(SCHEMA)
    engine = Engine(EngineArgs(str(tiny_dir)))
    req = GenerateRequest(
        "c",
        prompt,
        max_tokens=N_NEW,
        tokens_per_step=tokens_per_step,
        steering=ours,
        grammar=grammar,
        stream_denoise=True,
    )
    steps = run_steps(engine, req)

    matcher = LLMatcher(ll_tokenizer(False, vocab), grammar)
    x = prompt + [MASK_ID] * N_NEW
    drafts_refused = 0
    for s in steps:
        logits = official_step_logits(gen, x, ref)
        first = x.index(MASK_ID)
        assert s.positions == list(range(first, first + len(s.positions))), "not the leftmost positions"
        masked = logits[first].masked_fill(~allowed(matcher, vocab), float("-inf"))
        assert s.token_ids[0] == int(masked.argmax()), f"step {s.step}: not the masked argmax"
        for pos, tok in zip(s.positions[1:], s.token_ids[1:]):
            assert tok == int(logits[pos].argmax()), f"step {s.step}: a draft that is not the argmax"
        assert matcher.consume_tokens(s.token_ids)
        nxt = first + len(s.positions)
        if tokens_per_step > 1 and len(s.positions) < tokens_per_step and not matcher.is_stopped():
            # The step stopped early: its next draft (the argmax there) is one the grammar refuses.
            assert not allowed(matcher, vocab)[int(logits[nxt].argmax())]
            drafts_refused += 1
        for pos, tok in zip(s.positions, s.token_ids):
            x[pos] = tok
    assert matcher.is_stopped(), "the grammar did not complete"
    text = gen.tokenizer.decode([t for t in x[64:] if t != MASK_ID])
    assert set(json.loads(text)) == {"word", "n", "flag"}
    if tokens_per_step > 1:
        assert len(steps) < sum(len(s.positions) for s in steps), "no draft was ever kept"
        assert drafts_refused > 0, "no draft was ever refused: the rule's second branch is untested"
    # The steering is real: the unsteered constrained answer differs.
    plain = engine.generate(
        [GenerateRequest("p", prompt, max_tokens=N_NEW, tokens_per_step=tokens_per_step, grammar=grammar)]
    )
    assert plain["p"] != [t for t in x[64:] if t != MASK_ID]
