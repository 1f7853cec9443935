"""worker/logit_rules.py: OpenAI's frequency/presence penalties and logit_bias, vLLM's min_tokens
and ignore_eos, per request inside the batch. Each pass is checked against the documented
arithmetic applied in the test to the logits the model gave that pass."""

import pytest
import torch
from cde.shared.config import EOT_ID, preset
from cde.shared.protocol import GenerateRequest
from cde.worker.checkpoint import random_model, save_checkpoint
from cde.worker.engine import Engine, EngineArgs
from cde.worker.logit_rules import add_item_rows

from tests.worker.test_sampler import BANNED, PROMPT_B, gen, run_checked

PROMPT = PROMPT_B * 5
# Pushes two tokens far above the rest: they repeat, and their counts decide between them.
PUSHED = {7: 30.0, 8: 29.0}


def generated_of(req, context):
    """The tokens generated so far. run_checked's context repeats the prompt, which the first
    block's tokens hold too: every request here fits its prompt and its tokens in one block."""
    assert len(req.prompt_ids) + req.max_tokens <= 64
    return context[2 * len(req.prompt_ids) :]


def reference_choice(req, logits, context):
    """The documented rule: logit - count * frequency - (count > 0) * presence + bias, then the
    bans; counts over the tokens the request generated so far (not its prompt)."""
    x = logits.clone()
    counts = torch.bincount(torch.tensor(generated_of(req, context), dtype=torch.long), minlength=x.shape[1])
    x -= counts.float() * req.frequency_penalty + (counts > 0).float() * req.presence_penalty
    for token, value in req.logit_bias.items():
        x[:, token] += value
    x[:, list(BANNED)] = float("-inf")
    return x


@pytest.mark.slow
def test_penalties_and_logit_bias_follow_the_formula(tiny_dir):
    engine = Engine(EngineArgs(str(tiny_dir), max_running=4))
    checked = {"mix": 0, "ban": 0, "plain": 0}

    def check(req, logits, eligible, pick, context):
        x = reference_choice(req, logits, context)
        # The reference's selection: topk over the still-masked positions' confidences, packed
        # (its tie order: this model's confidences tie at 1.0).
        masked = eligible.nonzero().squeeze(-1)
        conf = torch.softmax(x[masked], -1).amax(-1)
        assert pick.positions == [int(masked[conf.topk(1).indices[0]])], req.request_id
        assert pick.tokens == [int(x[pick.positions[0]].argmax())], req.request_id
        checked[req.request_id] += 1

    plain = gen(engine, [GenerateRequest("p0", PROMPT, max_tokens=10)])["p0"]
    reqs = [
        GenerateRequest("mix", PROMPT, max_tokens=10, frequency_penalty=1.0, presence_penalty=0.5, logit_bias=PUSHED),
        GenerateRequest("ban", PROMPT, max_tokens=10, logit_bias={plain[0]: -100.0, 4000: 2.5}),
        GenerateRequest("plain", PROMPT, max_tokens=10),
    ]
    out = run_checked(engine, reqs, check)
    assert checked == {"mix": 10, "ban": 10, "plain": 10}
    assert out["plain"] == plain  # the rows of the others were untouched
    assert plain[0] not in out["ban"]
    # counts above 1 were in play: the penalty grew with each repeat and the pushed tokens alternated
    assert set(out["mix"]) == set(PUSHED) and max(out["mix"].count(t) for t in PUSHED) >= 3


@pytest.mark.slow
def test_a_reused_slot_starts_with_no_counts(tiny_dir):
    """One slot, two penalized requests in turn: the second equals itself on a fresh engine."""
    second = dict(max_tokens=8, frequency_penalty=1.0, logit_bias=PUSHED)
    fresh = gen(Engine(EngineArgs(str(tiny_dir), max_running=1)), [GenerateRequest("b", PROMPT, **second)])["b"]
    engine = Engine(EngineArgs(str(tiny_dir), max_running=1))
    gen(engine, [GenerateRequest("a", PROMPT, max_tokens=8, frequency_penalty=0.5, logit_bias={7: 30.0})])
    assert gen(engine, [GenerateRequest("b", PROMPT, **second)])["b"] == fresh


def eot_engine(path) -> Engine:
    """A tiny instruct checkpoint whose EOT row dominates every position's logits (the LM head
    is tied: a large dimension 0 in every hidden state, EOT's weight there much larger)."""
    cfg = preset("tiny", instruct=True)
    model = random_model(cfg, seed=1)
    with torch.no_grad():
        w = model.transformer.lm_head.weight
        w[:, 0] = 20.0
        w[EOT_ID, 0] += 4.0
        model.transformer.ln_f.weight[0] = 1.0
    save_checkpoint(model, cfg, path)
    return Engine(EngineArgs(str(path), max_running=4))


@pytest.mark.slow
def test_min_tokens_and_ignore_eos(tmp_path):
    engine = eot_engine(tmp_path / "eot")
    ended = {}

    def check(req, logits, eligible, pick, context):
        x = logits.clone()
        x[:, list(BANNED)] = float("-inf")
        start = len(req.prompt_ids)  # one block: block positions are sequence positions
        for p in range(start, start + req.max_tokens):
            before = sum(not eligible[g] for g in range(start, p))  # tokens unmasked before p
            if eligible[p] and before < req.min_tokens:
                x[p, [EOT_ID, *req.stop_token_ids]] = float("-inf")
        # The reference's selection: topk over the still-masked positions' confidences, packed
        # (its tie order: this model's confidences tie at 1.0).
        masked = eligible.nonzero().squeeze(-1)
        conf = torch.softmax(x[masked], -1).amax(-1)
        assert pick.positions == [int(masked[conf.topk(1).indices[0]])], req.request_id
        assert pick.tokens == [int(x[pick.positions[0]].argmax())], req.request_id
        ended[req.request_id] = ended.get(req.request_id, False) or EOT_ID in pick.tokens

    reqs = [
        GenerateRequest("plain", PROMPT_B, max_tokens=16),
        GenerateRequest("min", PROMPT_B, max_tokens=16, min_tokens=6, stop_token_ids=[5]),
        GenerateRequest("ignore", PROMPT_B, max_tokens=16, ignore_eos=True),
    ]
    out = run_checked(engine, reqs, check)
    assert out["plain"] == []  # EOT first, at once
    assert 6 <= len(out["min"]) < 16 and ended["min"]  # ended by EOT, after at least min_tokens
    assert len(out["ignore"]) == 16 and out["ignore"].count(EOT_ID) > 1  # EOT is a plain token


@pytest.mark.parametrize("alpha", [1.0, -1.0])
def test_item_rows_added_as_runs_and_as_a_gather_give_the_same_bits(alpha):
    """add_item_rows' CPU form (each item's run of consecutive rows, a broadcast view) and the
    GPU's (one index_add_ of the gathered table rows) against x[r] + alpha * table[item of r],
    with runs broken by an item change and by a gap, and rows outside `rows` untouched."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 50, generator=gen)
    table = torch.randn(3, 50, generator=gen)
    row_item = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 0, 0])
    rows = torch.tensor([0, 1, 2, 4, 5, 7, 9])  # 0-1 item 0; 2 item 1, gap, 4 item 1; 5 and 7 item 2 ...
    want = x.clone()
    for r in rows.tolist():
        want[r] = x[r] + alpha * table[row_item[r]]
    for runs in (True, False):
        got = x.clone()
        add_item_rows(got, rows, row_item, table, alpha=alpha, runs=runs)
        assert torch.equal(got, want), runs


def check_only_kept_picks_counted(engine: Engine, prompt: list[int]) -> None:
    """A constrained request drafts tokens_per_step picks and its grammar keeps a prefix of them
    (worker/constraint.py): the repetition penalty's seen tokens are its prompt and what it kept,
    and the frequency counts are what it kept, never a refused draft (the last pass's picks end
    the request: nothing after it reads them). `engine` runs one request at a time."""
    from collections import Counter

    from cde.shared.grammar import lark_grammar

    req = GenerateRequest(
        "c",
        prompt,
        max_tokens=48,
        tokens_per_step=4,
        repetition_penalty=1.5,
        frequency_penalty=0.5,
        grammar=lark_grammar("start: /[0-9]{1,30}/"),
    )
    out = engine.generate([req])["c"]
    assert out and engine.forward_passes > -(-len(out) // 4) + 1  # some pass kept fewer than it drafted
    seen = set(engine.runner.seen[0].nonzero().flatten().tolist())
    assert set(prompt) | set(out[:-4]) <= seen <= set(prompt) | set(out)
    counts = Counter({t: int(engine.runner.rules.counts[0, t]) for t in set(out) | seen})
    assert Counter(out[:-4]) <= +counts <= Counter(out)


@pytest.mark.slow
def test_only_the_picks_a_grammar_keeps_count_for_the_penalties(tiny_dir):
    check_only_kept_picks_counted(Engine(EngineArgs(str(tiny_dir), max_running=1)), PROMPT)
