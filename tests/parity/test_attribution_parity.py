"""Faithful attribution equals the official `FaithfulConceptAttributor` on the same greedy
generation: per committed token the known and discovered top-k indices, their weights and
contributions, the target logit and epsilon; and the rendered chunks equal its chunk results."""

import numpy as np
import pytest
import torch
from cde.shared.chunk_attribution import aggregate
from cde.shared.config import preset
from cde.shared.protocol import AttributionSpec, GenerateRequest
from cde.shared.tokenizer import Tokenizer
from cde.worker.checkpoint import load_checkpoint
from cde.worker.concept_contributions import attribute, head_widths
from cde.worker.engine import Engine, EngineArgs

pytestmark = pytest.mark.reference

WORDS = "the quick brown fox jumps over lazy dog while seven red birds sing under a bright summer sky near old river"
TOL = {"rtol": 1e-4, "atol": 1e-5}


def text_prompt() -> tuple[str, list[int]]:
    """A 64-token text prompt: the reference attributor takes text, the engine token ids."""
    words = WORDS.split()
    text = " ".join(words[i % len(words)] for i in range(64))
    ids = Tokenizer().encode(text)
    assert len(ids) == 64
    return text, ids


def reference(model_dir, text: str, n_new: int, per_step: int):
    from steerling.attribution.concept_attribution import FaithfulConceptAttributor

    from tests.oracle import greedy_config, official_generator

    attributor = FaithfulConceptAttributor(official_generator(model_dir), concepts_path="/nonexistent")
    cfg = greedy_config(n_new, per_step)
    out, chunks = attributor.attribute(text, cfg)
    return out, chunks, attributor.last_attribution


def ours(model_dir, ids: list[int], n_new: int, per_step: int):
    engine = Engine(EngineArgs(str(model_dir)))
    engine.add_request(
        GenerateRequest(
            "a", ids, max_tokens=n_new, tokens_per_step=per_step, attribution=AttributionSpec(chunking="endofchunk")
        )
    )
    tokens, records = [], []
    while engine.has_work():
        for res in engine.step():
            tokens += res.token_ids
            records += res.attribution
    return tokens, records


@pytest.mark.parametrize("n_new,per_step", [(64, 1), (128, 2)])
def test_records_and_chunks_match_faithful_attributor(tiny_dir, n_new, per_step):
    text, ids = text_prompt()
    out, ref_chunks, attr = reference(tiny_dir, text, n_new, per_step)
    tokens, records = ours(tiny_dir, ids, n_new, per_step)
    assert tokens == out.tokens[len(ids) :].tolist()
    assert [r["position"] for r in records] == list(range(len(ids), len(ids) + n_new))
    for r in records:
        p = r["position"]
        assert r["token_id"] == int(attr.target_token_ids[0, p])
        for kind, idx, w, c in (
            ("known", attr.known_indices, attr.known_weights, attr.known_contributions),
            ("discovered", attr.unk_indices, attr.unk_weights, attr.unk_contributions),
        ):
            got = np.array(r[kind])
            assert got[:, 0].astype(int).tolist() == idx[0, p].tolist(), (kind, p)
            np.testing.assert_allclose(got[:, 1], w[0, p].numpy(), **TOL)
            np.testing.assert_allclose(got[:, 2], c[0, p].numpy(), **TOL)
        np.testing.assert_allclose(r["target_logit"], float(attr.target_logits[0, p]), **TOL)
        np.testing.assert_allclose(r["epsilon"], float(attr.epsilon_contribution[0, p]), **TOL)
    # Steps are the reference's global denoising step of each commit.
    assert sorted({r["step"] for r in records}) == list(range(n_new // per_step))

    rendered = aggregate(
        records, Tokenizer().decode, prompt_len=len(ids), chunking="endofchunk", n_known=preset("tiny").n_concepts
    )["chunks"]
    assert len(rendered) == len(ref_chunks)
    for chunk, (entries, eps_pct) in zip(rendered, ref_chunks):
        got = {(c["label"], c["type"]): c["contribution"] for c in chunk["concepts"]}
        want = {(e["label"], e["type"]): e["contribution"] for e in entries}
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), **TOL)
        np.testing.assert_allclose(chunk["epsilon_pct"], eps_pct, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_contributions_of_given_states_are_the_official_accumulators_in_each_dtype(small_dir, dtype):
    """The same final states and committed tokens through the official accumulator and CDE's
    attribution, the model in `dtype`: in bfloat16 the discovered embeddings round as the
    reference builds them (basis(coef) in the model's dtype)."""
    from steerling.attribution.concept_attribution import AttributionAccumulator, _compute_unknown_topk
    from steerling.attribution.trace import CommitRecord

    from tests.oracle import official_model

    ref, _ = official_model(small_dir, dtype=dtype)
    cfg, model = load_checkpoint(small_dir, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    n = 24
    hidden = torch.randn(1, n, cfg.n_embd, generator=gen).to(dtype)
    tokens = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
    with torch.inference_mode():
        target = ref.transformer.lm_head(hidden)[0, torch.arange(n), tokens]
        known = ref.known_head(hidden)
        u_idx, u_logits = _compute_unknown_topk(ref.unknown_head, hidden, k=ref.unknown_head.topk)
        acc = AttributionAccumulator(
            n, ref.known_head.topk, ref.unknown_head.topk, torch.device("cpu"),
            ref.transformer.lm_head.weight, ref.known_head, ref.unknown_head,
        )  # fmt: skip
        acc.commit(
            CommitRecord(
                commit_order=0, denoising_step=0, positions=torch.arange(n), token_ids=tokens, target_logits=target,
                known_indices=known.topk_indices[0], known_logits=known.topk_logits[0],
                unk_indices=u_idx[0], unk_logits=u_logits[0],
            )
        )  # fmt: skip
        rows = attribute(model, cfg, hidden[0], tokens, target)
    kk, ku = head_widths(cfg)
    u0 = 2 + 3 * kk
    assert torch.equal(rows[:, 2 : 2 + kk].long(), acc.known_indices[0])
    assert torch.equal(rows[:, u0 : u0 + ku].long(), acc.unk_indices[0])
    for got, want in (
        (rows[:, 2 + 2 * kk : 2 + 3 * kk], acc.known_contributions[0]),
        (rows[:, u0 + 2 * ku : u0 + 3 * ku], acc.unk_contributions[0]),
        (rows[:, 1], acc.residual_contribution[0]),
    ):
        np.testing.assert_allclose(got.numpy(), want.double().numpy(), rtol=1e-5, atol=1e-5)
