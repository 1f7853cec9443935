"""Faithful attribution equals the official `FaithfulConceptAttributor` on the same greedy
generation: per committed token the known and discovered top-k indices, their weights and
contributions, the target logit and epsilon; and the rendered chunks equal its chunk results."""

import numpy as np
import pytest
from cde.shared.chunk_attribution import aggregate
from cde.shared.config import preset
from cde.shared.protocol import AttributionSpec, GenerateRequest
from cde.shared.tokenizer import Tokenizer
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
