"""The training forward (cde/train/train_model.py) against the official steerling model: a trained
model's checkpoint, loaded by the official classes, must compute what training computed —
the block-causal trunk, a noisy block over clean earlier blocks, packed documents, steering
injection and the concept heads' features."""

import pytest
import torch
from cde.shared.config import MASK_ID, PAGE

from cde.train.export import export
from cde.train.program import model_config
from cde.train.train_model import TrainModel, block_causal_mask, clean_noisy_mask
from tests.oracle import official_model

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.manual_seed(0)
    used = sorted({*range(0, 3000, 3), MASK_ID})
    model = TrainModel(model_config("mini"), used)
    with torch.no_grad():  # sharper than the 0.02 init, so that differences show
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(5.0)
    out = export(model, tmp_path_factory.mktemp("pair") / "m", torch.float32)
    official, _ = official_model(out)
    return model.eval(), official


def _ids(model, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return model.used[torch.randint(0, model.n_used, (1, n), generator=g)]


@torch.no_grad()
def test_block_causal_trunk_and_logits_match_official(pair):
    model, official = pair
    ids = _ids(model, 3 * PAGE)
    mine = model.hidden(ids, torch.arange(ids.shape[1])[None], block_causal_mask(torch.zeros_like(ids)))
    logits, outs = official(ids)
    torch.testing.assert_close(mine, outs.hidden, atol=2e-5, rtol=1e-4)
    compact = model.logits(mine)
    torch.testing.assert_close(compact[..., :-1], logits[..., model.used], atol=1e-4, rtol=1e-4)
    unused = torch.ones(logits.shape[-1], dtype=torch.bool)
    unused[model.used] = False
    assert logits[..., unused].abs().max() < 1e-5  # zero rows: the constant UNUSED column is exact


@torch.no_grad()
def test_noisy_blocks_and_packed_documents_match_official(pair):
    model, official = pair
    ids = _ids(model, 3 * PAGE, seed=2)
    doc = torch.tensor([[0] * 2 * PAGE + [1] * PAGE])
    pos = torch.cat([torch.arange(2 * PAGE), torch.arange(PAGE)])[None]
    masked = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) < 0.5
    noisy = torch.where(masked, MASK_ID, ids)
    both = model.hidden(torch.cat([ids, noisy], 1), torch.cat([pos, pos], 1), clean_noisy_mask(doc))
    length = ids.shape[1]
    for b in range(2):  # document 0: block b denoised over its clean blocks < b
        ref = official(torch.cat([ids[:, : b * PAGE], noisy[:, b * PAGE : (b + 1) * PAGE]], 1))[1].hidden
        torch.testing.assert_close(
            both[:, length + b * PAGE : length + (b + 1) * PAGE], ref[:, -PAGE:], atol=2e-5, rtol=1e-4
        )
    # document 1 starts at position 0 and sees nothing of document 0
    ref = official(noisy[:, 2 * PAGE :])[1].hidden
    torch.testing.assert_close(both[:, -PAGE:], ref, atol=2e-5, rtol=1e-4)
    ref = official(ids)[1].hidden  # the clean copy is the plain block-causal forward of document 0
    torch.testing.assert_close(both[:, : 2 * PAGE], ref[:, : 2 * PAGE], atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_steering_injection_matches_official(pair):
    model, official = pair
    ids = _ids(model, 2 * PAGE, seed=4)
    direction = torch.randn(model.cfg.n_embd)
    at = torch.zeros(ids.shape, dtype=torch.bool)
    at[:, PAGE + 5 :] = True
    injection = direction * at[..., None]
    inject_layer, alpha = 2, 3.5
    ref = official._forward_with_injection(ids, None, injection, inject_layer, alpha)
    gates = (torch.arange(1, model.cfg.n_layers + 1) >= inject_layer).float()[:, None]
    mine = model.hidden(
        ids, torch.arange(ids.shape[1])[None], block_causal_mask(torch.zeros_like(ids)), alpha * injection, gates
    )
    torch.testing.assert_close(mine, ref, atol=2e-5, rtol=1e-4)
    plain = model.hidden(ids, torch.arange(ids.shape[1])[None], block_causal_mask(torch.zeros_like(ids)))
    assert (mine - plain).abs().max() > 1e-2  # the injection did something


@torch.no_grad()
def test_concept_features_match_official_heads(pair):
    model, official = pair
    h = torch.randn(1, 16, model.cfg.n_embd)
    torch.testing.assert_close(model.known_features(h), official.known_head(h).features, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(model.unknown_features(h), official.unknown_head(h).features, atol=1e-5, rtol=1e-4)
