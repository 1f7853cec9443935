"""`shared.chunk_attribution.aggregate` renders chunks exactly as the reference's `chunk_attribution`
(with `find_chunk_boundaries` for <|endofchunk|> spans and `ConceptLabels` for names), run on the
same per-token numbers: the engine's records loaded into the reference's own result type."""

import numpy as np
import pytest
import torch
from cde.shared.chunk_attribution import aggregate, load_concept_labels
from cde.shared.config import ENDOFCHUNK_ID, EOT_ID, MASK_ID, preset
from cde.shared.protocol import AttributionSpec, GenerateRequest
from cde.shared.tokenizer import Tokenizer
from cde.worker.engine import Engine, EngineArgs

pytestmark = pytest.mark.reference

PROMPT_LEN, N_NEW = 64, 128
N_KNOWN = preset("tiny").n_concepts
TOL = {"rtol": 1e-5, "atol": 1e-7}


@pytest.fixture(scope="module")
def records(tiny_dir):
    prompt = torch.randint(0, 100000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = Engine(EngineArgs(str(tiny_dir)))
    engine.add_request(GenerateRequest("a", prompt, max_tokens=N_NEW, tokens_per_step=4, attribution=AttributionSpec()))
    out = []
    while engine.has_work():
        for res in engine.step():
            out += res.attribution
    return out


def as_reference(records):
    """The records as the reference's OutputToConceptAttribution over prompt + generation."""
    from steerling.attribution.concept_attribution import OutputToConceptAttribution

    seq = PROMPT_LEN + N_NEW
    kk, ku = len(records[0]["known"]), len(records[0]["discovered"])
    t = {
        name: torch.zeros(1, seq, k)
        for name, k in (("ki", kk), ("kw", kk), ("kc", kk), ("ui", ku), ("uw", ku), ("uc", ku))
    }
    tok, tgt, eps, committed = (
        torch.zeros(1, seq, dtype=torch.long),
        torch.zeros(1, seq),
        torch.zeros(1, seq),
        torch.zeros(1, seq, dtype=torch.bool),
    )
    for r in records:
        p = r["position"]
        for prefix, kind in (("k", "known"), ("u", "discovered")):
            for col, name in enumerate("iwc"):
                t[prefix + name][0, p] = torch.tensor([e[col] for e in r[kind]])
        tok[0, p], tgt[0, p], eps[0, p], committed[0, p] = r["token_id"], r["target_logit"], r["epsilon"], True
    return OutputToConceptAttribution(
        tok, tgt, t["ki"].long(), t["kw"], t["kc"], t["ui"].long(), t["uw"], t["uc"], eps, committed
    )


def assert_same(rendered, spans, attr, ref_labels):
    from steerling.attribution.concept_attribution import chunk_attribution

    assert [(c["start"] + PROMPT_LEN, c["end"] + PROMPT_LEN) for c in rendered] == spans
    for chunk, (start, end) in zip(rendered, spans):
        entries, eps_pct = chunk_attribution(attr, start, end, concept_labels=ref_labels, num_known_concepts=N_KNOWN)
        assert [(c["label"], c["type"]) for c in chunk["concepts"]] == [(e["label"], e["type"]) for e in entries]
        np.testing.assert_allclose(
            [c["contribution"] for c in chunk["concepts"]], [e["contribution"] for e in entries], **TOL
        )
        if np.isnan(eps_pct):  # the mean over no committed position: null in JSON
            assert chunk["epsilon_pct"] is None and not chunk["concepts"]
        else:
            np.testing.assert_allclose(chunk["epsilon_pct"], eps_pct, **TOL)


def labels_file(tmp_path, records, fmt: str):
    """Names for some concepts the generation used, discovered ones in the unified id space."""
    r = records[0]
    rows = [
        (r["known"][0][0], "alpha", "known"),
        (r["known"][1][0], "beta", "known"),
        (r["discovered"][0][0] + N_KNOWN, "gamma", "unknown"),
    ]
    path = tmp_path / f"labels.{fmt}"
    if fmt == "csv":
        path.write_text("concept_id,concept_name,head\n" + "".join(f"{i},{n},{h}\n" for i, n, h in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        cols = list(zip(*rows))
        pq.write_table(
            pa.table({"concept_id": list(cols[0]), "concept_name": list(cols[1]), "head": list(cols[2])}), path
        )
    return path


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_block_chunks_match_reference(records, tmp_path, fmt):
    from steerling.attribution.concept_attribution import ConceptLabels

    path = labels_file(tmp_path, records, fmt)
    out = aggregate(
        records, Tokenizer().decode, prompt_len=PROMPT_LEN, labels=load_concept_labels(path), n_known=N_KNOWN
    )
    spans = [(64, 128), (128, 192)]
    assert_same(out["chunks"], spans, as_reference(records), ConceptLabels(path))
    labels = {c["label"] for chunk in out["chunks"] for c in chunk["concepts"]}
    assert {"Known: alpha", "Known: beta", "Discovered: gamma"} <= labels


def test_endofchunk_chunks_match_reference(records):
    from steerling.attribution.concept_attribution import ConceptLabels
    from steerling.attribution.utils import find_chunk_boundaries

    marked = [dict(r) for r in records]
    # adjacent markers give an empty chunk, as a marker first does; the last closes the text
    for offset in (0, 10, 11, 70, N_NEW - 1):
        marked[offset]["token_id"] = ENDOFCHUNK_ID
    attr = as_reference(marked)
    spans = find_chunk_boundaries(
        attr.target_token_ids[0].tolist(), eoc_id=ENDOFCHUNK_ID, start_index=PROMPT_LEN, include_final_chunk=True
    )
    out = aggregate(
        marked, Tokenizer().decode, prompt_len=PROMPT_LEN, chunking="endofchunk", n_known=N_KNOWN, per_token=True
    )
    assert sum(s == e for s, e in spans) == 2
    assert_same(out["chunks"], spans, attr, ConceptLabels("/nonexistent"))
    assert [t["offset"] for t in out["tokens"]] == list(range(N_NEW))
    first = out["tokens"][0]["concepts"]
    assert [abs(c["contribution"]) for c in first] == sorted((abs(c["contribution"]) for c in first), reverse=True)


@pytest.mark.parametrize("chunking", ["endofchunk", "block"])
def test_a_generation_that_eot_ends_with_holes_divides_as_the_reference(tiny_instruct_dir, chunking):
    """<|eot_id|> committed while positions before it are still masked ends the generation there
    (the reference's generate_full); those positions are never unmasked, yet the reference's last
    chunk, [start, EOT), counts them in its length (find_chunk_boundaries stops at EOT)."""
    from steerling.attribution.concept_attribution import ConceptLabels
    from steerling.attribution.utils import find_chunk_boundaries

    prompt = torch.randint(0, 100000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = Engine(EngineArgs(str(tiny_instruct_dir)))
    # EOT banned for six tokens, then the most confident: committed with masks left before it.
    req = GenerateRequest(
        "a", prompt, max_tokens=64, attribution=AttributionSpec(), logit_bias={EOT_ID: 13.0}, min_tokens=6
    )
    engine.add_request(req)
    results = []
    while engine.has_work():
        results += engine.step()
    records = [r for res in results for r in res.attribution]
    end = results[-1].end_position
    assert results[-1].finish_reason == "stop" and end is not None  # EOT ended it, and its position is told
    tokens = prompt + [MASK_ID] * 64
    for r in records:
        tokens[r["position"]] = r["token_id"]
    tokens[end] = EOT_ID
    assert len(records) == 6 and MASK_ID in tokens[PROMPT_LEN:end], "no holes before EOT: the test would be vacuous"
    spans = find_chunk_boundaries(
        tokens, eoc_id=ENDOFCHUNK_ID, start_index=PROMPT_LEN, stop_ids=[EOT_ID], include_final_chunk=True
    )
    out = aggregate(records, Tokenizer().decode, prompt_len=PROMPT_LEN, chunking=chunking, n_known=N_KNOWN, end=end)
    assert_same(out["chunks"], spans, as_reference(records), ConceptLabels("/nonexistent"))


@pytest.mark.parametrize("chunking", ["endofchunk", "block"])
def test_a_generation_that_eot_ends_at_once_has_no_chunk(chunking):
    """<|eot_id|> as the first generated token: the reference's find_chunk_boundaries gives no span."""
    from steerling.attribution.utils import find_chunk_boundaries

    tokens = [1] * PROMPT_LEN + [EOT_ID] + [MASK_ID] * 63
    spans = find_chunk_boundaries(
        tokens, eoc_id=ENDOFCHUNK_ID, start_index=PROMPT_LEN, stop_ids=[EOT_ID], include_final_chunk=True
    )
    out = aggregate([], Tokenizer().decode, prompt_len=PROMPT_LEN, chunking=chunking, n_known=N_KNOWN, end=PROMPT_LEN)
    assert out["chunks"] == spans == []


@pytest.mark.parametrize("chunking", ["endofchunk", "block"])
def test_input_chunks_end_where_eot_ended_the_generation(tiny_instruct_dir, chunking):
    """The input attribution's last chunk is the reference's too ([start, EOT), its average over
    the committed tokens), so the response joins it to the concept chunk of the same span."""
    from cde.gateway.input_attribution_render import attach, render_block
    from cde.shared.protocol import InputAttributionSpec
    from steerling.attribution.utils import find_chunk_boundaries

    prompt = torch.randint(0, 100000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = Engine(EngineArgs(str(tiny_instruct_dir)))
    spec = AttributionSpec(chunking=chunking, inputs=InputAttributionSpec(top_k=5, steps=1))
    engine.add_request(
        GenerateRequest("a", prompt, max_tokens=64, attribution=spec, logit_bias={EOT_ID: 13.0}, min_tokens=6)
    )
    results = []
    while engine.has_work():
        results += engine.step()
    end = results[-1].end_position
    assert end is not None
    records = [r for res in results for r in res.attribution]
    tokens = prompt + [MASK_ID] * 64
    for r in records:
        tokens[r["position"]] = r["token_id"]
    tokens[end] = EOT_ID
    spans = find_chunk_boundaries(
        tokens, eoc_id=ENDOFCHUNK_ID, start_index=PROMPT_LEN, stop_ids=[EOT_ID], include_final_chunk=True
    )
    inputs = [res.input_attribution for res in results]
    assert [tuple(s) for ia in inputs for s in ia.chunk_spans] == spans
    concept = aggregate(records, Tokenizer().decode, prompt_len=PROMPT_LEN, chunking=chunking, end=end)
    joined = attach(concept, [render_block(ia, PROMPT_LEN, Tokenizer().decode) for ia in inputs])
    assert all("inputs" in chunk for chunk in joined["chunks"])
