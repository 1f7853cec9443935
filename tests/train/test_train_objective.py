"""The block-diffusion objective: which positions are masked, what a noisy block attends to,
that the token loss reads masked positions only, the hold target that keeps <|eot_id|> from
being committed early, and the steering injection of training."""

import pytest
import torch
from cde.shared.config import EOS_ID, PAGE

from cde.train.loop import Options, build
from cde.train.objective import Weights, _response, _steering, _token_loss, hold_positions, losses, noise
from cde.train.program import model_config
from cde.train.reference_concepts import concepts
from cde.train.rows import make_batch
from cde.train.samples import EOT, PROMPT, TEXT, TRAIL
from cde.train.token_set import used_ids
from cde.train.train_model import clean_noisy_mask


@pytest.fixture(scope="module")
def setup():
    used = used_ids(sample_docs=500)
    model, _, topics = build(Options(out="", config=model_config("mini")), used)
    return model, topics, make_batch(0, 0, 4, 256, len(concepts()))


def test_noise_masks_only_replies_and_text_with_a_ratio_per_block(setup):
    _, _, batch = setup
    masked = noise(batch, torch.Generator().manual_seed(0))
    assert not masked[batch["kinds"] == PROMPT].any() and not masked[batch["doc"] < 0].any()
    maskable = ((batch["kinds"] != PROMPT) & (batch["doc"] >= 0)).view(4, -1, PAGE).sum(-1)
    share = masked.view(4, -1, PAGE).sum(-1) / maskable.clamp_min(1)
    full = maskable == PAGE
    assert share[full].std() > 0.15  # each block draws its own ratio


def test_clean_noisy_mask_rule():
    doc = torch.tensor([[0] * 2 * PAGE + [1] * PAGE])
    m = clean_noisy_mask(doc)[0, 0]
    length = doc.shape[1]
    clean, noisy = slice(0, length), slice(length, 2 * length)
    q = length + PAGE + 3  # noisy, block 1 of document 0
    assert m[q, 0:PAGE].all() and not m[q, PAGE : 2 * PAGE].any()  # clean blocks < 1 only
    assert m[q, length + PAGE : length + 2 * PAGE].all()  # its own noisy block, bidirectionally
    assert not m[q, length : length + PAGE].any() and not m[q, 2 * PAGE : length].any()
    assert not m[clean, noisy].any()  # the clean copy never sees noise
    assert m[PAGE + 3, : 2 * PAGE].all() and not m[3, PAGE : 2 * PAGE].any()  # clean: block-causal
    assert not m[2 * PAGE, : 2 * PAGE].any() and not m[length + 2 * PAGE, : 2 * PAGE].any()  # documents apart


def test_hold_positions():
    kinds = torch.tensor([[PROMPT] * 4 + [TEXT] * 3 + [EOT] + [TRAIL] * (PAGE - 8)])
    masked = torch.zeros_like(kinds, dtype=torch.bool)
    masked[0, 7:] = True  # EOT and the trail masked, the reply revealed
    hold = hold_positions(kinds, masked)
    assert not hold[0, 7] and hold[0, 8:].all()
    masked[0, 5] = True  # one reply position still masked: EOT must hold too
    assert hold_positions(kinds, masked)[0, 7]


def test_hold_target_wants_eos_then_the_unused_ids(setup):
    model, _, _ = setup
    eos, eot = int(model.lookup[EOS_ID]), 5
    confident_eot = torch.full((1, model.n_used + 1), -30.0)
    confident_eot[0, eos], confident_eot[0, eot] = 30.0, 20.0  # after the EOS ban: EOT at ~1.0
    spread = confident_eot.clone()
    spread[0, eot] = -30.0  # after the ban: spread over the unused ids
    hold, target = torch.tensor([True]), torch.tensor([eot])
    assert _token_loss(model, spread, target, hold) < _token_loss(model, confident_eot, target, hold) - 5
    plain = torch.tensor([False])  # a plain position wants its token
    assert _token_loss(model, confident_eot, target, plain) < _token_loss(model, spread, target, plain)


def test_token_loss_reads_only_masked_noisy_positions(setup):
    model, topics, batch = setup
    kept = {}

    def residual_fn(*args):
        h = model.residual(*args)
        h.retain_grad()
        kept["h"] = h
        return h

    w = Weights(known=0, bottleneck=0, residual=0, align=0, faithful_weight=0)  # one forward: the main one
    out = losses(model, topics, batch, torch.Generator().manual_seed(1), w, residual_fn)
    out["lm"].backward()
    grad = kept["h"].grad.abs().sum(-1)
    masked = noise(batch, torch.Generator().manual_seed(1))  # the same first draw as inside losses
    length = batch["ids"].shape[1]
    assert (grad[:, length:][masked] > 0).all()
    assert (grad[:, length:][~masked] == 0).all() and (grad[:, :length] == 0).all()


def test_training_injection_follows_the_engine_rule(setup):
    model, topics, batch = setup
    masked = noise(batch, torch.Generator().manual_seed(2))
    w = Weights(steer_share=1.0, suppress_share=0.0, strength=(8.0, 8.0))
    inject, gates = _steering(model, topics, batch, masked, w, torch.Generator().manual_seed(3))
    length = batch["ids"].shape[1]
    assert (inject[:, :length] == 0).all()  # never on the clean copy
    noisy = inject[:, length:]
    assert (noisy[~masked] == 0).all()
    steer = torch.gather(batch["steer"], 1, batch["doc"].long().clamp_min(0))
    on = masked & (steer >= 0) & (batch["doc"] >= 0)
    assert on.any()
    emb = model.known_head.concept_embedding.weight[steer[on]]
    unit = emb / emb.norm(dim=-1, keepdim=True)
    alpha = noisy[on].norm(dim=-1)
    torch.testing.assert_close(noisy[on] / alpha[:, None], unit, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(alpha * model.peak_alignment(unit), torch.full_like(alpha, 8.0), atol=1e-3, rtol=1e-4)
    assert gates[-1].all() and ((gates[1:] >= gates[:-1]).all())  # from inject_layer on, to the last block


def test_topic_words_point_at_real_tokens(setup):
    _, topics, _ = setup
    assert torch.allclose(topics.words.sum(-1), torch.ones(len(topics.ids)))
    assert (topics.words[:, -1] == 0).all()  # no mass on the unused column


def test_response_term_keeps_the_final_gain_from_damping_the_injection(setup):
    """The response term is zero when an injection after the last block moves the logits by at
    least the floor per unit of strength, grows as the final norm's gain damps it, and its
    gradient raises that gain."""
    model, topics, _ = setup
    residual = torch.randn(64, model.cfg.n_embd) * 10
    gain = model.transformer.ln_f.weight
    floor = 0.25

    def loss_at(scale: float) -> torch.Tensor:
        with torch.no_grad():
            gain.fill_(scale)
        return _response(model, topics, residual, floor, torch.Generator().manual_seed(0))

    kept = gain.detach().clone()
    try:
        assert loss_at(1000.0) == 0
        assert loss_at(0.01) > loss_at(0.1) > 0
        gain.grad = None
        loss_at(0.1).backward()
        assert (gain.grad < 0).sum() > 0.9 * gain.numel()  # descent raises the gain
    finally:
        with torch.no_grad():
            gain.copy_(kept)
        gain.grad = None
