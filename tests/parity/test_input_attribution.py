"""Input attribution (integrated gradients over the snapshot each token was committed from)
equals the official `FaithfulOutputToInputAttributor` on the same greedy generation (float32
CPU, block-aligned prompt, 1 and 2 IG steps) at about 16 of its commit groups spread over it, and a
steered request equals an independent replay: the official model classes and the official IG
primitive, with forward hooks adding the injection the official generator applied in that step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cde.shared.config import PAGE
from cde.shared.protocol import BlockResult, GenerateRequest, SteeringSpec
from cde.worker.engine import Engine, EngineArgs
from cde.worker.input_attribution import Target, attribute, build_targets
from cde.worker.steering import prepare_steering

from tests.parity.test_attribution_parity import text_prompt

pytestmark = pytest.mark.reference

REL = 1e-4  # max |ours - official| over max |official|, per target


def run_engine(model_dir, req: GenerateRequest) -> tuple[Engine, list[tuple[int, int, int]], list[int]]:
    """Generate with the engine; the request's commit history ((position, token, step) in
    commit order, recorded from what the scheduler places) and its tokens."""
    engine = Engine(EngineArgs(str(model_dir)))
    engine.add_request(req)
    seq = engine.scheduler.waiting[-1]
    commits: list[tuple[int, int, int]] = []
    place = seq.place

    def recording_place(positions: list[int], tokens: list[int]) -> bool:
        ended = place(positions, tokens)
        n = tokens.index(seq.eot_id) + 1 if ended else len(tokens)
        commits.extend((seq.block * PAGE + p, t, seq.step) for p, t in zip(positions[:n], tokens[:n]))
        return ended

    seq.place = recording_place
    return engine, commits, _drain(engine, req.request_id)


def _drain(engine: Engine, request_id: str) -> list[int]:
    out: list[int] = []
    while engine.has_work():
        for res in engine.step():
            if res.request_id == request_id and isinstance(res, BlockResult):
                out += res.token_ids
    return out


def ours(
    engine: Engine, prompt: list[int], commits: list, positions: list[int], n_steps: int, steering=None
) -> dict[int, np.ndarray]:
    targets = build_targets(prompt, commits, positions, steering)
    attrs = attribute(engine.runner.model, targets, n_steps, steering, token_budget=1024)
    return {t.position: a.numpy() for t, a in zip(targets, attrs)}


def compare(got: dict[int, np.ndarray], ref_positions, ref_attr: np.ndarray) -> float:
    """Assert per target: ours equals the reference on its prefix, the reference is zero past
    it. Returns the largest relative error seen."""
    worst = 0.0
    assert sorted(got) == sorted(int(p) for p in ref_positions)
    for n, p in enumerate(ref_positions):
        mine, ref = got[int(p)], ref_attr[n]
        scale = float(np.abs(ref).max())
        assert scale > 0, f"target {p}: the reference attribution is all zero, the test would be vacuous"
        assert np.abs(ref[len(mine) :]).max(initial=0.0) == 0.0
        err = float(np.abs(mine - ref[: len(mine)]).max()) / scale
        worst = max(worst, err)
        assert err <= REL, (int(p), err)
    return worst


@pytest.mark.parametrize(
    "which,n_new,per_step,n_steps",
    [
        ("tiny_dir", 128, 1, 1),  # the second block's snapshots hold generated tokens
        # Two tokens per step: one snapshot per commit group. More than one IG step: the
        # interpolation (alphas 1/2, 1) and the average over steps (each step is a forward and a
        # backward of every target in the official IG, so two and not more).
        ("tiny_dir", 64, 2, 2),
        ("small_dir", 64, 1, 1),  # the larger shape (GQA groups, width); two per step and 2 IG steps are tiny's
    ],
)
def test_input_attribution_matches_official(which, n_new, per_step, n_steps, request, record_property):
    from steerling.attribution.input_attribution import FaithfulOutputToInputAttributor, _TraceRecorder

    from tests.oracle import greedy_config, official_generator

    model_dir = request.getfixturevalue(which)
    text, ids = text_prompt()
    attributor = FaithfulOutputToInputAttributor(official_generator(model_dir))
    # The official `attribute`, split open to attribute only some of the commit groups: its IG
    # is a forward and a backward per group and IG step, most of a case's time, and each group
    # stands alone (its snapshot comes from the whole trace, which stays whole).
    recorder, prompt_t, cfg = _TraceRecorder(), attributor._encode_prompt(text), greedy_config(n_new, per_step)
    attributor.generator.generate_full(prompt_t, cfg, step_callback=recorder)
    trace = attributor._build_trace(prompt_t, cfg, recorder.groups)
    object.__setattr__(trace, "groups", sampled(recorder.groups))
    ref = attributor.attribute_from_trace(trace, n_steps=n_steps)

    engine, commits, tokens = run_engine(
        model_dir, GenerateRequest("a", ids, max_tokens=n_new, tokens_per_step=per_step)
    )
    assert tokens == trace.committed_tokens()[len(ids) :].tolist()
    # The commit order is the official one: each group's tokens committed in one step, every group.
    steps = {pos: step for pos, _, step in commits}
    for group in recorder.groups:
        assert len({steps[q] for q in group.positions.tolist()}) == 1
    got = ours(engine, ids, commits, ref.target_positions.tolist(), n_steps)
    worst = compare(got, ref.target_positions.tolist(), ref.attributions.numpy())
    record_property("max_rel_err", worst)
    print(f"{which} n_new={n_new} per_step={per_step} steps={n_steps}: max relative error {worst:.2e}")


def sampled(groups: list) -> list:
    """About 16 of the commit groups, spread over the generation (both blocks of a 128-token
    one), the last included."""
    picked = groups[:: max(1, len(groups) // 16)]
    return picked if picked[-1] is groups[-1] else [*picked, groups[-1]]


def official_steered_replay(gen, prompt: list[int], cfg, steering, n_steps: int):
    """The official generator's steered run recorded with the official trace recorder, then IG
    with the official primitive per commit group, the generator's own injection re-applied by
    forward hooks on the official blocks (direction at the snapshot's masked positions, the
    generator's alpha for that snapshot, after every layer i with i + 1 >= inject_layer)."""
    from steerling.attribution.input_attribution import OutputToInputAttributor, _clear_inference_caches, _TraceRecorder
    from steerling.attribution.trace import DiffusionTrace

    recorder = _TraceRecorder()
    prompt_t = torch.tensor([prompt])
    gen.generate_full(prompt_t, cfg, steering=steering, step_callback=recorder)
    trace = DiffusionTrace(
        prompt_ids=prompt_t[0],
        prompt_len=len(prompt),
        seq_length=len(prompt) + cfg.max_new_tokens,
        mask_id=int(gen.mask_token_id),
        eos_id=None,
        device=torch.device("cpu"),
        groups=recorder.groups,
    )
    model = gen.model
    _clear_inference_caches(model)
    direction, base_alpha, inject_layer = gen._prepare_steering(steering)
    primitive = OutputToInputAttributor.from_backbone(model, baseline="mask", mask_token_id=int(gen.mask_token_id))
    baseline = model.transformer.tok_emb(torch.full((trace.seq_length,), trace.mask_id)).detach()
    positions, attrs = [], []
    for group in sampled(trace.groups):  # the snapshots still come from the whole trace
        x = trace.reconstruct(group.commit_order)
        masked_remaining = int((x == trace.mask_id).sum())
        alpha = gen._resolve_alpha(
            steering.inject_alpha_schedule, base_alpha, masked_remaining, cfg.max_new_tokens, steering.cutoff_tokens
        )
        inj = (x == trace.mask_id).float()[None, :, None] * direction.float()[None, None, :]
        hooks = [
            block.register_forward_hook(lambda _m, _i, out, inj=inj, alpha=alpha: out + alpha * inj)
            for i, block in enumerate(model.transformer.blocks)
            if i + 1 >= inject_layer
        ]
        try:
            res = primitive.compute(
                x[None].expand(len(group.positions), -1).contiguous(),
                group.token_ids,
                group.positions,
                n_steps=n_steps,
                baseline_embedding=baseline,
            )
        finally:
            for h in hooks:
                h.remove()
        positions += group.positions.tolist()
        attrs.append(res.attributions)
    return trace.committed_tokens()[len(prompt) :].tolist(), positions, torch.cat(attrs).numpy()


def test_steered_input_attribution_matches_independent_replay(tiny_dir):
    from steerling.configs.steering import SteeringConfig

    from tests.oracle import greedy_config, official_generator

    # Two IG steps: the injection is added to interpolated inputs too (at alpha 1/2, not only 1).
    n_new, n_steps = 64, 2
    prompt = torch.randint(0, 100000, (64,), generator=torch.Generator().manual_seed(7)).tolist()
    spec = SteeringSpec([3, 17, 40], strength=8.0, normalize=True, inject_layer=1, cutoff_tokens=32)
    ref_cfg = SteeringConfig.injection([3, 17, 40], mai_lm_target=8.0, inject_layer=1, cutoff_tokens=32)
    gen = official_generator(tiny_dir)
    ref_tokens, ref_pos, ref_attr = official_steered_replay(gen, prompt, greedy_config(n_new, 1), ref_cfg, n_steps)

    engine, commits, tokens = run_engine(tiny_dir, GenerateRequest("s", prompt, max_tokens=n_new, steering=spec))
    assert tokens == ref_tokens
    state = prepare_steering(engine.runner.model, engine.cfg, spec)
    got = ours(engine, prompt, commits, ref_pos, n_steps, state)
    compare(got, ref_pos, ref_attr)
    # The injection matters: without it the attributions of the steered steps differ.
    plain = ours(engine, prompt, commits, ref_pos[:4], n_steps)
    assert any(np.abs(plain[p] - got[p]).max() > 1e-3 * np.abs(got[p]).max() for p in ref_pos[:4])


def test_targets_are_the_snapshots_the_model_saw():
    mask = 100280
    prompt = list(range(66))  # two prompt tokens in block 1, the first decode block
    commits = [(67, 5, 1), (66, 6, 2), (68, 7, 2), (130, 8, 3)]  # (position, token, step)
    t = {x.position: x for x in build_targets(prompt, commits, [66, 67, 68, 130])}
    assert isinstance(t[67], Target) and t[67].token_id == 5
    assert t[67].snapshot == prompt + [mask] * 62
    assert t[66].snapshot == prompt + [mask, 5] + [mask] * 60
    assert t[68].snapshot == t[66].snapshot  # committed in the same step: both still masked
    assert t[130].snapshot == prompt + [6, 5, 7] + [mask] * 59 + [mask] * 64
