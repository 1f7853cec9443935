"""`stream_denoise`: per-step events from the engine (StepResult) and over the API (SSE `step`
events between the per-block events), on the tiny models."""

import json

import httpx
import openai
import pytest
from cde.gateway.attribution_render import renderer
from cde.gateway.concepts import ConceptLabels
from cde.gateway.denoise import DenoiseView
from cde.gateway.model_info import ModelInfo
from cde.shared.config import EOT_ID, PAGE
from cde.shared.protocol import AttributionSpec, BlockResult, GenerateRequest, SteeringSpec, StepResult
from cde.shared.tokenizer import Tokenizer
from cde.worker.engine import Engine, EngineArgs


def _run(engine: Engine, *reqs: GenerateRequest) -> list:
    for r in reqs:
        engine.add_request(r)
    out = []
    while engine.has_work():
        out += engine.step()
    return out


def _blocks_with_their_steps(results: list, request_id: str) -> list[tuple[list[StepResult], BlockResult]]:
    """Each BlockResult of the request with the StepResults sent since its previous one."""
    out, steps = [], []
    for r in results:
        if r.request_id != request_id:
            continue
        if isinstance(r, StepResult):
            steps.append(r)
        else:
            out.append((steps, r))
            steps = []
    assert steps == [], "step events after the last block"
    return out


# ---- engine ------------------------------------------------------------------------------------
def test_steps_assemble_each_block_and_land_out_of_order(tiny_dir):
    prompt = list(range(500, 517))  # 17 tokens: the first block is the prompt's tail block
    req = GenerateRequest(
        "d",
        prompt,
        max_tokens=150,
        tokens_per_step=3,
        stream_denoise=True,
        steering=SteeringSpec([3], inject_layer=1),
        attribution=AttributionSpec(top_k=4),
    )
    blocks = _blocks_with_their_steps(_run(Engine(EngineArgs(str(tiny_dir))), req), "d")
    assert len(blocks) == 3 and blocks[-1][1].finish_reason == "length"
    last_step, out_of_order = 0, 0
    for steps, block in blocks:
        (absolute_block,) = {s.block for s in steps}
        positions = [p for s in steps for p in s.positions]
        by_position = dict(zip(positions, [t for s in steps for t in s.token_ids]))
        # Every generated cell of the block lands exactly once, and together they are the block.
        start = max(absolute_block * PAGE, len(prompt))
        end = min((absolute_block + 1) * PAGE, len(prompt) + req.max_tokens)
        assert sorted(positions) == list(range(start, end))
        assert [by_position[p] for p in range(start, end)] == block.token_ids
        # One event per step, numbered on from the previous block, at most tokens_per_step each.
        assert [s.step for s in steps] == list(range(last_step + 1, last_step + 1 + len(steps)))
        assert all(1 <= len(s.positions) <= 3 for s in steps)
        last_step = steps[-1].step
        out_of_order += positions != sorted(positions)
        # The step records are the block's records, already sent as the tokens landed.
        records = sorted((r for s in steps for r in s.attribution), key=lambda r: r["position"])
        assert records == block.attribution
        assert [(r["position"], r["token_id"]) for s in steps for r in s.attribution] == list(by_position.items())
    assert out_of_order == len(blocks)  # confidence order, not left to right


def test_only_requests_that_ask_get_steps_and_decoding_is_unchanged(tiny_dir):
    prompt = [7, 8, 9, 10]
    results = _run(
        Engine(EngineArgs(str(tiny_dir))),
        GenerateRequest("plain", prompt, max_tokens=70, tokens_per_step=2, seed=1),
        GenerateRequest("steps", prompt, max_tokens=70, tokens_per_step=2, seed=1, stream_denoise=True),
    )
    steps = [r for r in results if isinstance(r, StepResult)]
    assert steps and {s.request_id for s in steps} == {"steps"}
    assert all(s.attribution is None for s in steps)  # attribution was not asked
    plain = [t for r in results if isinstance(r, BlockResult) and r.request_id == "plain" for t in r.token_ids]
    streamed = [t for r in results if isinstance(r, BlockResult) and r.request_id == "steps" for t in r.token_ids]
    assert plain == streamed and len(plain) == 70


def test_the_step_that_commits_eot_ends_with_it(tiny_instruct_dir, tmp_path):
    """Make <|eot_id|> the greedy pick mid-block (as in test_engine); picks after it in the same
    step are discarded, and so are they in the step event."""
    import torch
    from cde.worker.checkpoint import load_checkpoint, save_checkpoint

    prompt = list(range(1000, 1064))
    base = Engine(EngineArgs(str(tiny_instruct_dir))).generate(
        [GenerateRequest("b", prompt, max_tokens=128, tokens_per_step=4)]
    )["b"]
    cfg, model = load_checkpoint(tiny_instruct_dir)
    with torch.no_grad():
        model.transformer.lm_head.weight[EOT_ID] = model.transformer.lm_head.weight[base[80]] * 1.05
    save_checkpoint(model, cfg, tmp_path)
    spec = AttributionSpec(top_k=3)
    req = GenerateRequest("e", prompt, max_tokens=128, tokens_per_step=4, stream_denoise=True, attribution=spec)
    blocks = _blocks_with_their_steps(_run(Engine(EngineArgs(str(tmp_path))), req), "e")
    steps, last = blocks[-1]
    assert last.finish_reason == "stop" and EOT_ID not in last.token_ids
    assert steps[-1].token_ids[-1] == EOT_ID and all(EOT_ID not in s.token_ids for s in steps[:-1])
    # The block keeps what landed before EOT, in position order; what landed after it is dropped.
    landed = {p: t for s in steps for p, t in zip(s.positions, s.token_ids)}
    eot_at = steps[-1].positions[-1]
    assert any(p > eot_at for p in landed) and [landed[p] for p in sorted(landed) if p < eot_at] == last.token_ids
    # The running concepts of the step that ends the answer are its final chunk's, to the bit:
    # over the tokens before EOT (not those that landed after it), added in token order.
    tokenizer, labels = Tokenizer(instruct=True), ConceptLabels()
    info = ModelInfo("tiny", cfg.context_len, cfg.vocab_size, True, cfg.n_layers, cfg.n_concepts)
    view = DenoiseView(0, req, tokenizer, labels, cfg.n_concepts)
    running = [view.step(s).payload.attribution["chunk"] for s in steps][-1]
    generated = sum(len(b.token_ids) for _, b in blocks)
    final = renderer([req], tokenizer, labels, info)(0, [b.attribution for _, b in blocks], generated, eot_at)
    assert running == {k: v for k, v in final["chunks"][-1].items() if k != "text"}
    assert running["end"] == eot_at - len(prompt)


# ---- API ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_chat_server):
    return tiny_chat_server


def _sse(server, path: str, body: dict) -> list[tuple[str | None, dict | str]]:
    """(event kind, data) of every SSE event, in order."""
    events, kind = [], None
    with httpx.stream("POST", server.base_url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                data = line[len("data: ") :]
                events.append((kind, data if data == "[DONE]" else json.loads(data)))
                kind = None
    return events


REQUEST = {
    "model": "tiny",
    "prompt": "The quick brown fox",
    "max_tokens": 100,
    "temperature": 0,
    "tokens_per_step": 4,
    "return_token_ids": True,
    "steering": {"concepts": [3], "strength": 8},
    "attribution": {"top_k": 3},
}


def test_sse_has_step_events_between_block_events(server):
    events = _sse(server, "/completions", {**REQUEST, "stream": True, "stream_denoise": True})
    assert events[-1] == (None, "[DONE]")
    chunks = events[:-1]
    assert {k for k, _ in chunks} == {"step", None}
    block_events = [d for k, d in chunks if k is None and d["choices"][0]["text"]]
    assert len(block_events) == 2  # 4 prompt tokens: blocks of 60 and 40 new tokens
    cells: dict[int, int] = {}
    final_chunks = chunks[-1][1]["choices"][0]["attribution"]["chunks"]
    last_step = None
    for kind, data in chunks:
        (c,) = data["choices"]
        if kind == "step":
            assert data["object"] == "text_completion.step" and data["id"] == chunks[0][1]["id"]
            assert len(c["offsets"]) == len(c["token_ids"]) == len(c["tokens"]) >= 1
            cells.update(zip(c["offsets"], c["token_ids"]))
            last_step = c
        elif c["text"]:  # a block event closes the steps before it: they assembled its tokens
            assert last_step is not None and [cells[o] for o in sorted(cells)] == c["token_ids"]
            # The running concept view of the block's last step is the block's final chunk.
            chunk = last_step["attribution"]["chunk"]
            (final,) = [f for f in final_chunks if f["start"] == chunk["start"]]
            assert chunk == {k: v for k, v in final.items() if k != "text"}  # the same doubles
            cells, last_step = {}, None
    whole = httpx.post(server.base_url + "/completions", json=REQUEST, timeout=60).json()
    text = "".join(d["choices"][0]["text"] for k, d in chunks if k is None)
    assert text == whole["choices"][0]["text"]


def test_streams_without_stream_denoise_have_no_step_events(server):
    assert all(kind is None for kind, _ in _sse(server, "/completions", {**REQUEST, "stream": True}))
    blocks = {**REQUEST, "stream": True, "stream_granularity": "block"}
    events = _sse(server, "/completions", blocks)
    assert all(kind is None for kind, _ in events)
    assert [bool(d["choices"][0]["text"]) for _, d in events[:-1]] == [True, True, False]
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    args = {k: v for k, v in REQUEST.items() if k in ("model", "prompt", "max_tokens", "temperature")}
    extra = {k: v for k, v in blocks.items() if k not in args and k != "stream"}
    chunks = list(client.completions.create(stream=True, extra_body=extra, **args))
    assert [c.object for c in chunks] == ["text_completion"] * 3
    assert "".join(c.choices[0].text for c in chunks) == "".join(d["choices"][0]["text"] for _, d in events[:-1])


def test_chat_step_events_and_per_token_attribution(server):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 24,
        "temperature": 0,
        "tokens_per_step": 8,
        "stream": True,
        "stream_denoise": True,
        "attribution": {"top_k": 2, "per_token": True},
    }
    steps = [d["choices"][0] for k, d in _sse(server, "/chat/completions", body) if k == "step"]
    assert len(steps) == 3
    for c in steps:
        tokens = c["attribution"]["tokens"]
        assert [t["offset"] for t in tokens] == c["offsets"] and [t["token_id"] for t in tokens] == c["token_ids"]
        assert all(len(t["concepts"]) == 2 for t in tokens)
    assert sorted(o for c in steps for o in c["offsets"]) == list(range(24))


@pytest.mark.parametrize(
    "path, body",
    [
        ("/completions", {"prompt": "x"}),
        ("/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ],
)
def test_stream_denoise_needs_stream(server, path, body):
    r = httpx.post(server.base_url + path, json={"model": "tiny", "stream_denoise": True, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_denoise"
