"""Input attribution through a real `cde serve` (tiny base model, CPU, one worker) and the
official `openai` client: each choice's `attribution.inputs` holds every generated token's top
input positions with the integrated gradients that the engine computes in this process over the
same commit snapshots (themselves equal to the official attributor's, see
tests/parity/test_input_attribution.py), each chunk its aggregated inputs; streamed, a block's
input attribution arrives in that block's event; bad values are a 400 naming the parameter."""

from __future__ import annotations

import openai
import pytest
from cde.shared.protocol import GenerateRequest
from cde.worker.engine import Engine, EngineArgs
from cde.worker.input_attribution import attribute, build_targets

from tests.api_server import ServerProcess

PROMPT = [(7919 * i) % 100000 for i in range(64)]
N_NEW, TOP_K = 128, 4


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerProcess(tiny_dir, "--served-model-name", "tiny", workers=1)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def expected(tiny_dir) -> dict[int, list[float]]:
    """Position -> its [T] attribution, from the engine and the IG core in this process (steps 1)."""
    engine = Engine(EngineArgs(str(tiny_dir)))
    engine.add_request(GenerateRequest("e", PROMPT, max_tokens=N_NEW))
    seq = engine.scheduler.waiting[-1]
    while engine.has_work():
        engine.step()
    targets = build_targets(PROMPT, seq.commits, [p for p, _, _ in seq.commits])
    return {t.position: a.tolist() for t, a in zip(targets, attribute(engine.runner.model, targets, 1))}


def body(**inputs: object) -> dict:
    return {"attribution": {"top_k": 3, "inputs": {"top_k": TOP_K, "steps": 1, **inputs}}}


def check_tokens(tokens: list[dict], expected: dict[int, list[float]], first_offset: int = 0) -> None:
    for n, tok in enumerate(tokens):
        assert tok["offset"] == first_offset + n
        attr = expected[len(PROMPT) + tok["offset"]]
        want = sorted(range(len(PROMPT)), key=lambda q: -abs(attr[q]))[:TOP_K]
        assert [i["position"] for i in tok["inputs"]] == want
        assert [i["token_id"] for i in tok["inputs"]] == [PROMPT[q] for q in want]
        assert [i["contribution"] for i in tok["inputs"]] == pytest.approx([attr[q] for q in want], rel=1e-4)
        assert all(isinstance(i["text"], str) for i in tok["inputs"]) and isinstance(tok["text"], str)


def test_completion_carries_input_attribution(client, expected):
    r = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=N_NEW, temperature=0, extra_body={**body(), "return_token_ids": True}
    )
    choice = r.choices[0]
    attribution = choice.model_extra["attribution"]
    inputs = attribution["inputs"]
    assert [t["token_id"] for t in inputs["tokens"]] == choice.model_extra["token_ids"]
    assert len(inputs["tokens"]) == N_NEW
    check_tokens(inputs["tokens"], expected)
    # Each concept chunk (a 64-token block) gained its aggregated inputs, the response lists them too.
    assert [(c["start"], c["end"]) for c in attribution["chunks"]] == [(0, 64), (64, 128)]
    assert [c["inputs"] for c in attribution["chunks"]] == [c["inputs"] for c in inputs["chunks"]]
    for chunk in attribution["chunks"]:
        scores = [i["score"] for i in chunk["inputs"]]
        assert len(scores) == TOP_K and scores == sorted(scores, reverse=True)
        assert all(0 <= i["position"] < len(PROMPT) for i in chunk["inputs"])


@pytest.mark.parametrize(
    "case",
    [
        {"stop": "STOP"},  # the text of a generated token, set per run below
        {"logit_bias": {"100279": 4.0}, "chunking": "endofchunk"},  # <|endofchunk|> in a row: empty chunks
    ],
    ids=["stop", "empty_chunks"],
)
def test_every_concept_chunk_gets_its_inputs_and_tokens_end_with_the_completion(client, case):
    """The input attribution covers what the concept attribution covers: the completion's tokens
    (where a stop string cut it: those before the stop) and every concept chunk's span, empty
    ones too (the official aggregate_chunk over none is [])."""
    case, empty_chunks = dict(case), "logit_bias" in case
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=64, temperature=0)
    if "stop" in case:
        plain = client.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
        case["stop"] = plain.text[len(plain.text) // 2 :][:6]
    extra = body()
    extra["attribution"]["chunking"] = case.pop("chunking", "block")
    r = client.completions.create(**kw, stop=case.pop("stop", None), extra_body={**extra, **case})
    attribution = r.choices[0].model_extra["attribution"]
    inputs = attribution["inputs"]
    assert [t["offset"] for t in inputs["tokens"]] == list(range(r.usage.completion_tokens))
    spans = [(c["start"], c["end"]) for c in attribution["chunks"]]
    assert spans == [(c["start"], c["end"]) for c in inputs["chunks"]]
    assert all("inputs" in c for c in attribution["chunks"])
    if empty_chunks:
        empty = [c for c in attribution["chunks"] if c["start"] == c["end"]]
        assert empty and all(c["inputs"] == [] and c["epsilon_pct"] is None for c in empty)
    else:
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 64


def test_streamed_block_events_carry_their_input_attribution(client, expected):
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=N_NEW, temperature=0, stream=True, extra_body=body()
    )
    events = [c.choices[0].model_extra.get("attribution") for c in stream if c.choices]
    per_block = [e["inputs"] for e in events[:-1] if e and "inputs" in e]
    assert [len(b["tokens"]) for b in per_block] == [64, 64]
    assert [b["tokens"][0]["offset"] for b in per_block] == [0, 64]
    for b in per_block:
        check_tokens(b["tokens"], expected, b["tokens"][0]["offset"])
        assert len(b["chunks"]) == 1
    assert events[-1]["inputs"]["tokens"] == [t for b in per_block for t in b["tokens"]]


def test_scope_all_lists_generated_positions(client):
    """With scope "all" a token's inputs are every position its snapshot held: the prompt, the
    earlier blocks, and the tokens of its own block committed before it (so the i-th token
    committed in a block lists i more than the first)."""
    extra = {"attribution": {"inputs": {"top_k": 256, "steps": 1, "scope": "all"}}}
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N_NEW, temperature=0, extra_body=extra)
    tokens = r.choices[0].model_extra["attribution"]["inputs"]["tokens"]
    for block in range(2):
        mine = tokens[block * 64 : (block + 1) * 64]
        start = len(PROMPT) + block * 64
        assert sorted(len(t["inputs"]) for t in mine) == list(range(start, start + 64))
        for t in mine:
            assert all(
                0 <= i["position"] < start + 64 and i["position"] != start + t["offset"] % 64 for i in t["inputs"]
            )
            assert len({i["position"] for i in t["inputs"]}) == len(t["inputs"])


@pytest.mark.parametrize(
    "inputs,param",
    [
        ({"steps": 0}, "attribution.inputs.steps"),
        ({"steps": 65}, "attribution.inputs.steps"),
        ({"scope": "generated"}, "attribution.inputs.scope"),
        ({"top_k": 0}, "attribution.inputs.top_k"),
    ],
)
def test_bad_values_are_a_400_naming_the_param(client, inputs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=8, extra_body={"attribution": {"inputs": inputs}}
        )
    assert err.value.body["param"] == param


def test_chat_carries_input_attribution(tiny_instruct_dir):
    srv = ServerProcess(tiny_instruct_dir, "--served-model-name", "chat", workers=1)
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)
        r = client.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=16,
            temperature=0,
            extra_body={"attribution": {"inputs": {"top_k": 3, "steps": 2}}},
        )
        choice = r.choices[0]
        tokens = choice.model_extra["attribution"]["inputs"]["tokens"]
        assert tokens and [t["offset"] for t in tokens] == list(range(len(tokens)))
        n_prompt = r.usage.prompt_tokens
        for t in tokens:
            assert len(t["inputs"]) == 3 and all(0 <= i["position"] < n_prompt for i in t["inputs"])
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="chat",
                messages=[{"role": "user", "content": "hi"}],
                extra_body={"attribution": {"inputs": {"steps": 100}}},
            )
        assert err.value.body["param"] == "attribution.inputs.steps"
    finally:
        srv.stop()
