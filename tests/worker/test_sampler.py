"""worker/sampler.py: the reference's sampling distributions, counter-based seeded sampling
(reproducible, batch-invariant), confidence selection, bans and the repetition penalty."""

import pytest
import torch
from cde.shared.config import EOS_ID, MASK_ID, PAD_ID, PAGE, preset
from cde.shared.protocol import GenerateRequest
from cde.worker.checkpoint import random_model, save_checkpoint
from cde.worker.engine import Engine, EngineArgs
from cde.worker.last_block import finish
from cde.worker.sampler import entropy_temperature, filtered_log_probs, repetition_penalty, sampling_key

BANNED = (EOS_ID, MASK_ID, PAD_ID)


# ---- (a) the sampled distribution is the reference's ----------------------------------------------
def logit_cases():
    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(1000, generator=g)
    peaked[17] += 9.0
    two_modes = torch.randn(1000, generator=g) * 0.5
    two_modes[[3, 400]] += 4.0
    return {
        "flat": torch.randn(1000, generator=g) * 0.1,
        "normal": torch.randn(1000, generator=g) * 2.0,
        "peaked": peaked,
        "two_modes": two_modes,
        "wide": torch.randn(5000, generator=g) * 4.0,
    }


def reference_filtered(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The distribution the reference's `_sample_top_p` draws from, in vocabulary order."""
    sorted_probs, idx = torch.sort(probs, descending=True)
    keep = (torch.cumsum(sorted_probs, -1) - sorted_probs) <= top_p
    keep[0] = True
    filtered = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    filtered = filtered / filtered.sum()
    return torch.zeros_like(probs).scatter(-1, idx, filtered)


def assert_same_nucleus(ours, expected, top_p):
    differ = (ours > 0) != (expected > 0)
    if top_p < 1.0:
        assert not differ.any()
    else:
        # top_p 1 keeps everything in CDE; the reference's float32 cumsum can overshoot 1.0 and
        # drop part of a tail far below 1e-6
        assert (ours > 0).all() and (ours[differ] < 1e-6).all()


def reference_probs(monkeypatch, logits, **gen_kwargs):
    import steerling.inference.causal_diffusion as ref
    from steerling.configs.generation import GenerationConfig

    seen = []
    real = ref._sample_top_p

    def record(probs, top_p, generator=None):
        seen.append((probs.clone(), top_p))
        return real(probs, top_p, generator)

    monkeypatch.setattr(ref, "_sample_top_p", record)
    ref._sample_token(logits, GenerationConfig(**gen_kwargs))
    assert len(seen) == 1
    probs, top_p = seen[0]
    return reference_filtered(probs, top_p)


@pytest.mark.parametrize("top_p", [0.8, 0.95, 0.3, 1.0])
@pytest.mark.parametrize("case", sorted(logit_cases()))
def test_entropy_sampling_matches_reference(monkeypatch, case, top_p):
    logits = logit_cases()[case]
    expected = reference_probs(monkeypatch, logits, use_entropy_sampling=True, top_p=top_p)
    p = torch.tensor([top_p])
    temp = entropy_temperature(logits[None], p)
    assert 0.3 - 1e-6 <= temp.item() <= 0.7 + 1e-6
    ours = filtered_log_probs(logits[None], temp, p, torch.tensor([0])).exp()[0]
    assert torch.allclose(ours, expected, atol=1e-6, rtol=1e-4), (ours - expected).abs().max()
    assert_same_nucleus(ours, expected, top_p)


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.8), (1.2, 0.9), (0.5, 1.0), (2.0, 0.3)])
@pytest.mark.parametrize("case", ["normal", "peaked", "wide"])
def test_temperature_top_p_matches_reference(monkeypatch, case, temperature, top_p):
    logits = logit_cases()[case]
    expected = reference_probs(monkeypatch, logits, use_entropy_sampling=False, temperature=temperature, top_p=top_p)
    ours = filtered_log_probs(
        logits[None], torch.tensor([temperature]), torch.tensor([top_p]), torch.tensor([0])
    ).exp()[0]
    assert torch.allclose(ours, expected, atol=1e-6, rtol=1e-4)
    assert_same_nucleus(ours, expected, top_p)


def test_entropy_temperature_extremes():
    one_hot = torch.full((1, 100), -30.0)
    one_hot[0, 5] = 30.0
    uniform = torch.zeros(1, 100)
    p = torch.tensor([0.8])
    assert entropy_temperature(one_hot, p).item() == pytest.approx(0.3, abs=1e-4)
    assert entropy_temperature(uniform, p).item() == pytest.approx(0.7, abs=1e-6)


def test_top_k_and_rows_are_independent():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 200, generator=g)
    lp = filtered_log_probs(
        logits, torch.tensor([1.0, 1.0, 0.5]), torch.tensor([1.0, 1.0, 0.9]), torch.tensor([0, 5, 0])
    )
    probs = lp.exp()
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert (probs[0] > 0).all()  # top_p 1 keeps everything
    kept = (probs[1] > 0).nonzero().flatten()
    assert set(kept.tolist()) == set(logits[1].topk(5).indices.tolist())
    # one row's parameters do not leak into another's
    alone = filtered_log_probs(logits[2:], torch.tensor([0.5]), torch.tensor([0.9]), torch.tensor([0]))
    assert torch.allclose(alone, lp[2:])


def test_compact_sampling_equals_static_shapes():
    """The CPU samples only the slots that commit; the GPU path samples every slot with static
    shapes. Counter-based noise makes both pick the same tokens."""
    from cde.worker.sampler import SamplingBatch, select_and_sample

    g = torch.Generator().manual_seed(3)
    s, v = 3, 500
    grid = torch.full((s, 64), -1)
    rows = 0
    for i, n in enumerate((10, 64, 5)):
        grid[i, :n] = torch.arange(rows, rows + n)
        rows += n
    logits = torch.randn(rows, v, generator=g) * 3
    sb = SamplingBatch(
        grid=grid,
        row_item=torch.tensor([i for i, n in enumerate((10, 64, 5)) for _ in range(n)]),
        n_select=torch.tensor([2, 1, 3]),
        threshold=torch.tensor([2.0, 0.05, 2.0]),
        temperature=torch.tensor([0.9, 1.2, 0.0]),
        top_p=torch.tensor([0.95, 1.0, 1.0]),
        top_k=torch.tensor([0, 7, 0]),
        entropy=torch.tensor([False, False, False]),
        seed=torch.tensor([11, 12, 13]),
        step=torch.tensor([4, 9, 1]),
        banned=torch.tensor([0]),
        max_select=64,
        any_sampling=True,
    )
    compact = select_and_sample(logits.clone(), sb, compact=True)
    static = select_and_sample(logits.clone(), sb, compact=False)
    valid = compact[2]
    assert torch.equal(valid, static[2]) and valid.sum() > 4
    assert torch.equal(compact[1][valid], static[1][valid])


# ---- the engine ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine(EngineArgs(str(tiny_dir), max_running=4))


def gen(engine, reqs, max_passes=200):
    """engine.generate with a bound: a bug that never unmasks (e.g. choosing <|mask|>) fails
    instead of hanging; leftovers are aborted so the shared engine stays clean."""
    out = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    try:
        for _ in range(max_passes):
            if not engine.has_work():
                break
            for res in engine.step():
                out[res.request_id].extend(res.token_ids)
        assert not engine.has_work(), f"not finished after {max_passes} passes"
    finally:
        for r in reqs:
            engine.abort(r.request_id)
    return out


PROMPT_A = list(range(1000, 1070))  # 70 tokens: one full block + a tail
PROMPT_B = [5, 6, 7]


# ---- (b) seeded sampling ------------------------------------------------------------------------------
def test_seeded_sampling_reproducible_and_seed_dependent(engine):
    mk = lambda rid, seed: GenerateRequest(rid, PROMPT_B, max_tokens=4, temperature=0.8, seed=seed)
    first = gen(engine, [mk("a1", 11)])
    again = gen(engine, [mk("a2", 11), mk("b", 12), mk("c", 13)])
    assert len(first["a1"]) == 4 and again["a2"] == first["a1"]
    assert len({tuple(again[r]) for r in ("a2", "b", "c")}) == 3  # other seeds, other tokens


def test_the_sampling_key_counts_all_64_bits_of_a_seed():
    """A seed below 2**32 is its own key (its draws as they always were); seeds that differ only
    above bit 31 have other keys (the high half mixed by a bijection, so no two collide for one
    low half); a seed is its 64-bit two's complement pattern."""
    assert [sampling_key(s) for s in (0, 1, 12345, (1 << 32) - 1)] == [0, 1, 12345, (1 << 32) - 1]
    for low in (0, 7, (1 << 32) - 1):
        keys = {sampling_key(low + (high << 32)) for high in range(4096)}
        assert len(keys) == 4096 and all(0 <= k < 1 << 32 for k in keys)
    assert sampling_key(-1) == sampling_key((1 << 64) - 1) != sampling_key((1 << 63) - 1)
    assert sampling_key(-(1 << 63)) == sampling_key(1 << 63)


def test_seeded_sampling_is_batch_invariant(engine):
    req = lambda rid: GenerateRequest(rid, PROMPT_A, max_tokens=4, temperature=0.8, top_p=0.9, seed=99)
    alone = gen(engine, [req("alone")])["alone"]
    others = [
        GenerateRequest("o1", PROMPT_B, max_tokens=6, temperature=1.0, seed=1),
        GenerateRequest("o2", list(range(2000, 2130)), max_tokens=3, entropy_sampling=True, top_p=0.8, seed=2),
        GenerateRequest("o3", [9] * 10, max_tokens=4),
    ]
    # the others join before and after: the request shares passes with items at other blocks/steps
    for r in others[:2]:
        engine.add_request(r)
    engine.step()
    engine.add_request(req("crowd"))
    engine.step()
    engine.add_request(others[2])
    out = {}
    for _ in range(100):
        if not engine.has_work():
            break
        for res in engine.step():
            out.setdefault(res.request_id, []).extend(res.token_ids)
    assert not engine.has_work()
    assert out["crowd"] == alone
    assert len(out["o1"]) == 6 and len(out["o3"]) == 4


def test_entropy_sampling_seeded(engine):
    mk = lambda rid, seed: GenerateRequest(rid, PROMPT_B, max_tokens=4, entropy_sampling=True, top_p=0.8, seed=seed)
    out = gen(engine, [mk("e1", 3), mk("e2", 3), mk("e3", 4)])
    assert out["e1"] == out["e2"] and out["e1"] != out["e3"]


# ---- (c) selection, bans and repetition penalty, checked pass by pass -----------------------------
def run_checked(engine, reqs, check):
    """Drive the engine by hand; for every step item, hand `check` the item's 64-position logits
    (recomputed from the pass's output), its eligible mask and the picks."""
    model = engine.runner.model
    captured = {}
    handle = model.register_forward_hook(lambda m, args, out: captured.__setitem__("out", out))
    try:
        for r in reqs:
            engine.add_request(r)
        out = {r.request_id: [] for r in reqs}
        for _ in range(200):
            if not engine.has_work():
                break
            plan = engine.scheduler.schedule()
            for new in plan.new:
                engine.runner.start(new)
            if not plan.items:
                continue
            seqs = [engine.scheduler.running_in(it.slot) for it in plan.step_items]
            eligible = [it.eligible for it in plan.step_items]
            context = [
                list(seq.req.prompt_ids) + seq.generated + [t for t in seq.tokens if t != MASK_ID] for seq in seqs
            ]
            picks = engine.runner.picks(engine.runner.launch(plan))
            step_idx = [i for i, it in enumerate(plan.items) if it.is_step]
            with torch.inference_mode():
                for n, i in enumerate(step_idx):
                    hidden = finish(model, captured["out"], torch.arange(i * PAGE, (i + 1) * PAGE))
                    logits = model.logits(hidden).float()
                    check(seqs[n].req, logits, torch.tensor(eligible[n]), picks[n], context[n])
            for placed in engine.scheduler.place(plan, picks):
                for res in placed.results:
                    out[res.request_id].extend(res.token_ids)
        assert not engine.has_work(), "not finished after 200 passes"
    finally:
        handle.remove()
        for r in reqs:
            engine.abort(r.request_id)
    return out


def banned_conf(logits):
    x = logits.clone()
    x[:, list(BANNED)] = float("-inf")
    return x, torch.softmax(x, -1).amax(-1)


def test_tokens_per_step_selects_most_confident(engine):
    seen = {"steps": 0, "multi": 0}

    def check(req, logits, eligible, pick, context):
        positions, tokens = pick.positions, pick.tokens
        x, conf = banned_conf(logits)
        conf = conf.masked_fill(~eligible, -1.0)
        k = min(req.tokens_per_step, int(eligible.sum()))
        assert len(positions) == k
        assert all(eligible[p] for p in positions)
        top = conf.topk(k).values
        assert torch.allclose(conf[positions], top, atol=1e-6), (positions, conf.topk(k))
        assert tokens == x[positions].argmax(-1).tolist()  # greedy
        seen["steps"] += 1
        seen["multi"] += k > 1

    out = run_checked(
        engine,
        [
            GenerateRequest("k3", PROMPT_A, max_tokens=20, tokens_per_step=3),
            GenerateRequest("k1", PROMPT_B, max_tokens=5, tokens_per_step=1),
            GenerateRequest("k64", [], max_tokens=64, tokens_per_step=64),
        ],
        check,
    )
    assert [len(out[r]) for r in ("k3", "k1", "k64")] == [20, 5, 64]
    assert seen["multi"] >= 5


def test_confidence_threshold(engine):
    """Above-threshold positions are all taken, at least the most confident one. Three requests
    in one batch: threshold 0 (everything at once), 0.9999 (one per step) and one between this
    model's confidences (several at some steps, one at others)."""
    confs = []
    run_checked(
        engine,
        [GenerateRequest("probe", PROMPT_B, max_tokens=6)],
        lambda req, logits, el, pick, ctx: confs.append(banned_conf(logits)[1][el]),
    )
    middle = float(torch.cat(confs).quantile(0.9))
    counts = {0.0: [], 0.9999: [], middle: []}

    def check(req, logits, eligible, pick, context):
        positions = pick.positions
        threshold = req.confidence_threshold
        _, conf = banned_conf(logits)
        conf = conf.masked_fill(~eligible, -1.0)
        above = int((conf > threshold).sum())
        assert len(positions) == max(above, 1)
        assert all(eligible[p] for p in positions)
        if above == 0:
            assert positions == [int(conf.argmax())]
        else:
            assert set(positions) == set((conf > threshold).nonzero().flatten().tolist())
        counts[threshold].append(len(positions))

    reqs = [GenerateRequest(f"t{i}", PROMPT_B, max_tokens=12, confidence_threshold=t) for i, t in enumerate(counts)]
    out = run_checked(engine, reqs, check)
    assert all(len(out[r.request_id]) == 12 for r in reqs)
    assert counts[0.0] == [12]
    assert set(counts[0.9999]) == {1}
    assert 1 in counts[middle] and max(counts[middle]) > 1


def crafted_engine(path, lnf0: float, banned_extra: float) -> Engine:
    """A real checkpoint with a constant feature: every token embedding (tied with the LM head)
    has 20 in dimension 0, so every final hidden state has a large dimension 0 whose sign is
    ln_f.weight[0]. All logits then share an offset of that sign (the distribution is the same),
    and the banned ids' extra weight in dimension 0 makes the model prefer them."""
    cfg = preset("tiny")
    model = random_model(cfg, seed=1)
    with torch.no_grad():
        w = model.transformer.lm_head.weight
        w[:, 0] = 20.0
        w[list(BANNED), 0] += banned_extra
        model.transformer.ln_f.weight[0] = lnf0
    save_checkpoint(model, cfg, path)
    return Engine(EngineArgs(str(path), max_running=4))


def test_banned_ids_never_generated(tmp_path):
    """A model that prefers EOS, mask and pad by a wide margin never generates them."""
    engine = crafted_engine(tmp_path / "banned", lnf0=1.0, banned_extra=5.0)
    preferred = []

    def check(req, logits, eligible, pick, context):
        positions, tokens = pick.positions, pick.tokens
        preferred.extend(int(logits[p].argmax()) in BANNED for p in positions)
        assert not set(tokens) & set(BANNED)

    reqs = [
        GenerateRequest("g", PROMPT_B, max_tokens=6, tokens_per_step=2),
        GenerateRequest(
            "s", PROMPT_B, max_tokens=6, tokens_per_step=2, temperature=1.5, seed=1, repetition_penalty=2.0
        ),
        GenerateRequest("t", PROMPT_B, max_tokens=6, confidence_threshold=0.0),
    ]
    out = run_checked(engine, reqs, check)
    assert preferred and all(preferred)  # without the ban every pick would have been banned
    for r in reqs:
        assert len(out[r.request_id]) == 6 and not set(out[r.request_id]) & set(BANNED), r.request_id


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_repetition_penalty_formula(tiny_dir, tmp_path, sign):
    """Every step's choice is the reference rule: over the tokens already in the sequence,
    positive logits / p and negative logits * p, then bans, confidence and argmax. A request
    without penalty shares the batch and is untouched. sign -1: every logit is negative (only
    the negative branch acts); sign 1: every logit is positive."""
    penalty = 1.8
    engine = crafted_engine(tmp_path / "pen", lnf0=sign, banned_extra=0.0)
    signs = set()

    def check(req, logits, eligible, pick, context):
        positions, tokens = pick.positions, pick.tokens
        signs.update(torch.sign(logits[eligible]).unique().tolist())
        x = logits.clone()
        if req.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(context)))
            vals = x[:, seen]
            x[:, seen] = torch.where(vals > 0, vals / penalty, vals * penalty)
        x[:, list(BANNED)] = float("-inf")
        masked = eligible.nonzero().squeeze(-1)  # the reference's packed still-masked positions
        conf = torch.softmax(x[masked], -1).amax(-1)
        assert positions == [int(masked[conf.topk(1).indices[0]])]
        assert tokens == [int(x[positions[0]].argmax())]

    prompt = PROMPT_B * 5
    out = run_checked(
        engine,
        [
            GenerateRequest("rp", prompt, max_tokens=12, repetition_penalty=penalty),
            GenerateRequest("np", prompt, max_tokens=12),
        ],
        check,
    )
    assert signs == {sign}
    assert out["rp"] != out["np"]  # the penalty changed the output


def test_repetition_penalty_sparse_and_dense_give_the_same_bits():
    """The CPU's form (only the seen entries) and the GPU's (every entry of the rows, static
    shapes) against each other and against the rule written out: positive logits / p, others * p,
    on the seen tokens of the penalized rows only; zero and -inf logits included."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 1000, generator=gen)
    x[:, ::7] = 0.0
    x[3, 5] = float("-inf")
    seen = torch.rand(4, 1000, generator=gen) < 0.05
    seen[:, 5] = True
    penalty = torch.tensor([1.2, 1.0, 1.7, 0.9])
    rows = torch.tensor([0, 3, 4, 9, 11])
    item = torch.tensor([0, 2, 2, 3, 1])
    want = x.clone()
    for r, i in zip(rows.tolist(), item.tolist()):
        for t in seen[i].nonzero().flatten().tolist():
            v = want[r, t]
            want[r, t] = v / penalty[i] if v > 0 else v * penalty[i]
    for sparse in (True, False):
        got = x.clone()
        repetition_penalty(got, rows, item, seen, penalty, sparse=sparse)
        assert torch.equal(got, want), sparse
