"""The OpenAI API of a real `cde serve` (tiny instruct model, CPU, 2 workers), through the
official `openai` client."""

import json

import httpx
import openai
import pytest

from tests.api_server import ServerProcess

KEY = "test-key"
FAST = {"extra_body": {"tokens_per_step": 8}}  # 8 tokens per forward pass keeps the suite quick


@pytest.fixture(scope="module")
def server(tiny_instruct_dir):
    srv = ServerProcess(tiny_instruct_dir, "--served-model-name", "tiny", env={"CDE_API_KEY": KEY})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


def post(server, path, body, **kw):
    headers = {"Authorization": f"Bearer {KEY}", **kw.pop("headers", {})}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60, **kw)


# ---- happy paths ---------------------------------------------------------------------------------
def test_models(client):
    (m,) = client.models.list().data
    assert m.id == "tiny" and m.object == "model"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completion_shape(client):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=16, temperature=0, **FAST)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "tiny"
    (c,) = r.choices
    assert c.index == 0 and c.finish_reason in ("length", "stop") and c.logprobs is None
    assert r.usage.prompt_tokens == 1 and r.usage.completion_tokens == 16 and r.usage.total_tokens == 17


@pytest.mark.parametrize("granularity", ["token", "block"])
def test_streamed_equals_non_streamed_at_temperature_zero(client, granularity):
    args = dict(model="tiny", prompt="The quick brown fox", max_tokens=100, temperature=0)
    whole = client.completions.create(**args, **FAST)
    extra = {"tokens_per_step": 8, "stream_granularity": granularity}
    chunks = list(client.completions.create(stream=True, **args, extra_body=extra))
    text = "".join(c.choices[0].text for c in chunks)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    if granularity == "block":  # one event per 64-token block (the prompt's tail block, one more), then the finish
        assert [bool(c.choices[0].text) for c in chunks] == [True, True, False]
    else:  # committed prefixes as they grow: more events than blocks
        assert sum(bool(c.choices[0].text) for c in chunks) > 2


def test_chat_streamed_equals_non_streamed(client):
    args = dict(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        max_tokens=40,
        temperature=0,
        **FAST,
    )
    whole = client.chat.completions.create(**args)
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]


def test_n2_streams_interleave_with_one_finish_each(client):
    args = dict(model="tiny", prompt="a", max_tokens=200, temperature=0, **FAST)
    chunks = list(client.completions.create(n=2, stream=True, **args))
    by_index = {0: [], 1: []}
    for n, c in enumerate(chunks):
        (choice,) = c.choices
        by_index[choice.index].append((n, choice.text, choice.finish_reason))
    for events in by_index.values():
        reasons = [r for _, _, r in events]
        assert reasons[-1] is not None and sum(r is not None for r in reasons) == 1
        # greedy: each choice is the whole non-streamed text
        assert "".join(t for _, t, _ in events) == client.completions.create(**args).choices[0].text
    # Sent as they are generated, not one choice after the other.
    first, last = ({i: ev[0][0] for i, ev in by_index.items()}, {i: ev[-1][0] for i, ev in by_index.items()})
    assert first[1] < last[0] and first[0] < last[1], [c.choices[0].index for c in chunks]


def test_n2_and_prompt_lists(client):
    r = client.completions.create(model="tiny", prompt=["one", "two"], n=2, max_tokens=8, temperature=0, **FAST)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy: both samples of a prompt agree
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 32


def test_token_prompts_and_return_token_ids(client):
    r = client.completions.create(
        model="tiny",
        prompt=[[40, 41, 42], [7]],
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "tokens_per_step": 8},
    )
    c0, c1 = r.choices
    assert c0.prompt_token_ids == [40, 41, 42] and c1.prompt_token_ids == [7]
    assert len(c0.token_ids) == 8
    assert r.usage.prompt_tokens == 4


def test_stop_string_cuts_text(client):
    args = dict(model="tiny", prompt="x", max_tokens=64, temperature=0, **FAST)
    full = client.completions.create(**args).choices[0].text
    stop = full[10:13]
    assert stop.strip(), f"greedy text too uniform to pick a stop string: {full!r}"
    r = client.completions.create(stop=[stop, "never-appears"], **args)
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **args))
    assert streamed == r.choices[0].text
    # vLLM's include_stop_str_in_output: the stop string stays, and the tokens that wrote it count
    # (the last one whole, though the stop may end inside it)
    kept = dict(stop=stop, **{**args, "extra_body": {**FAST["extra_body"], "include_stop_str_in_output": True}})
    r = client.completions.create(**kept, logprobs=0)
    assert r.choices[0].text == full[: full.index(stop) + len(stop)] and r.choices[0].finish_reason == "stop"
    tokens = r.choices[0].logprobs.tokens
    assert "".join(tokens).startswith(r.choices[0].text) and not "".join(tokens[:-1]).startswith(r.choices[0].text)
    assert r.usage.completion_tokens == len(r.choices[0].logprobs.tokens)
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kept)) == r.choices[0].text


def test_include_usage_chunk(client):
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="hi",
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            **FAST,
        )
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10 and last.usage.prompt_tokens == 1
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_give_each_chunk_its_choices_usage_so_far(client):
    """vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk carries the
    usage of its choice so far (its prompt, the tokens it has returned, counted by their ids); the
    last chunk the whole usage. Without include_usage it adds nothing."""
    args = dict(
        model="tiny", max_tokens=12, temperature=0.8, seed=5, n=2, stream=True, extra_body={"tokens_per_step": 2}
    )
    chunks = list(
        client.completions.create(
            prompt=["hi", "hello there"],
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"tokens_per_step": 2, "return_token_ids": True},
            **{k: v for k, v in args.items() if k != "extra_body"},
        )
    )
    *body, last = chunks
    counted = [0] * 4
    for c in body:
        (choice,) = c.choices
        counted[choice.index] += len(choice.token_ids or [])
        assert c.usage.prompt_tokens == (1 if choice.index < 2 else 2)
        assert c.usage.completion_tokens == counted[choice.index]
        assert c.usage.total_tokens == c.usage.prompt_tokens + counted[choice.index]
        assert c.usage.prompt_tokens_details is None  # known with the last chunk
    assert len(body) > 4 and counted == [12] * 4
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 48)
    assert last.usage.prompt_tokens_details.cached_tokens == 0
    chat = list(
        client.chat.completions.create(
            messages=[{"role": "user", "content": "Hi"}],
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            **{**args, "n": 1},
        )
    )
    assert [c.usage.completion_tokens for c in chat[:-1]] == sorted(c.usage.completion_tokens for c in chat[:-1])
    assert chat[0].usage.completion_tokens == 0 and chat[-2].usage.completion_tokens == chat[-1].usage.completion_tokens
    plain = list(client.completions.create(prompt="hi", stream_options={"continuous_usage_stats": True}, **args))
    assert all(c.usage is None for c in plain)


def test_truncate_prompt_tokens_feeds_the_last_k(client, server):
    """vLLM's truncate_prompt_tokens: the prompt's last k ids are what is fed, counted and returned,
    so the answer is that of the last k ids sent as the prompt; chat truncates its templated ids."""
    extra = {"return_token_ids": True, "tokens_per_step": 8}
    ids = list(range(300, 340))
    cut = client.completions.create(
        model="tiny", prompt=ids, max_tokens=6, temperature=0, extra_body={**extra, "truncate_prompt_tokens": 8}
    )
    direct = client.completions.create(model="tiny", prompt=ids[-8:], max_tokens=6, temperature=0, extra_body=extra)
    assert cut.choices[0].prompt_token_ids == ids[-8:] and cut.usage.prompt_tokens == 8
    assert cut.choices[0].token_ids == direct.choices[0].token_ids
    messages = [{"role": "user", "content": "Say something about the sea and the sky."}]
    args = dict(model="tiny", messages=messages, max_tokens=2, temperature=0)
    full = client.chat.completions.create(**args, extra_body=extra).prompt_token_ids
    short = client.chat.completions.create(**args, extra_body={**extra, "truncate_prompt_tokens": 5})
    assert len(full) > 5 and short.prompt_token_ids == full[-5:] and short.usage.prompt_tokens == 5
    r = post(server, "/completions", {"model": "tiny", "prompt": "hi", "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_echo(client):
    args = dict(model="tiny", prompt="Echo me", max_tokens=4, temperature=0, **FAST)
    plain = client.completions.create(**args).choices[0].text
    assert plain and client.completions.create(echo=True, **args).choices[0].text == "Echo me" + plain


def test_steering_concepts_by_label(client):
    """Labels name the ids they spell (test_api_steering.py compares steering itself with the
    official package, on a base model)."""

    def text(steering=None):
        extra = {"tokens_per_step": 8, **({"steering": steering} if steering else {})}
        return (
            client.completions.create(model="tiny", prompt="steer", max_tokens=16, temperature=0, extra_body=extra)
            .choices[0]
            .text
        )

    plain = text()
    for by_id, by_label in (
        ({"concepts": [1, 2], "preset": "amplify"}, {"concepts": [1, "#2"], "preset": "amplify"}),
        ({"concepts": [3], "preset": "suppress"}, {"concepts": ["Known: #3"], "preset": "suppress"}),
    ):
        assert text(by_label) == text(by_id) != plain, by_label


def test_attribution(client):
    args = dict(model="tiny", prompt="attribute", max_tokens=70, temperature=0)
    extra = {"attribution": {"top_k": 3, "per_token": True}, "tokens_per_step": 8}
    r = client.completions.create(**args, extra_body=extra)
    att, tail = r.choices[0].attribution, 64 - r.usage.prompt_tokens  # answer tokens in the prompt's block
    assert [(c["start"], c["end"]) for c in att["chunks"]] == [(0, tail), (tail, 70)]
    assert all(len(c["concepts"]) == 3 for c in att["chunks"]) and len(att["tokens"]) == 70
    assert att["chunks"][0]["concepts"][0]["label"].startswith(("Known: #", "Discovered: #"))
    chunks = list(client.completions.create(**args, stream=True, extra_body=extra))
    assert [c.choices[0].attribution for c in chunks if c.choices[0].finish_reason] == [att]
    assert client.completions.create(**args, **FAST).choices[0].model_extra.get("attribution") is None


def test_every_sse_event_is_utf8_json(server):
    prompt = "Unicode: héllo 🎉 日本語 👩‍👩‍👧"  # the emoji are split across byte-level tokens
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 200,
        "temperature": 0,
        "echo": True,
        "stream": True,
        "tokens_per_step": 16,
    }
    with httpx.stream(
        "POST", server.base_url + "/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert all(e.startswith(b"data: ") for e in events)
    chunks = [json.loads(e[6:].decode("utf-8")) for e in events[:-1]]  # strict: broken UTF-8 raises
    assert chunks[0]["choices"][0]["text"] == prompt


# ---- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 200000]}, "prompt"),
        ({"prompt": "hi", "stop": [""]}, "stop"),
        ({"prompt": "hi", "stop": 5}, "stop"),
        ({"prompt": "hi", "logprobs": 6}, "logprobs"),
        ({"prompt": "hi", "logprobs": 1, "echo": True}, "echo"),
        ({"prompt": "hi", "stream_granularity": "step"}, "stream_granularity"),
        ({"prompt": "hi", "best_of": 3}, "best_of"),
        ({"prompt": "hi", "suffix": "end"}, "suffix"),
        ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
        ({"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias.99999999"),
        ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias.five"),
        ({"prompt": "hi", "logit_bias": {"5": -100, "05": 100}}, "logit_bias.05"),
        ({"prompt": "hi", "repetition_penalty": 1e-40}, "repetition_penalty"),
        ({"prompt": "hi", "steering": {"concepts": ["#\u0661\u0662"]}}, "steering.concepts"),
        ({"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"prompt": "hi", "frobnicate": 1}, "frobnicate"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "hi", "tokens_per_step": 65}, "tokens_per_step"),
        ({"prompt": "hi", "stop_token_ids": [999999]}, "stop_token_ids"),
        ({"prompt": "hi", "steering": {"concepts": [100000]}}, "steering.concepts"),
        ({"prompt": "hi", "steering": {"concepts": ["no such label"]}}, "steering.concepts"),
        ({"prompt": "hi", "steering": {"concepts": [1], "schedule": "sometimes"}}, "steering.schedule"),
        ({"prompt": "hi", "steering": {"concepts": [1], "inject_layer": -1}}, "steering.inject_layer"),
        ({"prompt": "hi", "attribution": {"chunking": "page"}}, "attribution.chunking"),
        ({"prompt": None}, "prompt"),
    ],
)
def test_invalid_completion_fields_are_400_with_param(client, body, param):
    fields = dict(body)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=fields.pop("prompt", None), extra_body=fields)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"]


def test_chat_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs" and "logprobs" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=21
        )
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
        )
    assert e.value.body["param"] == "tools.0.function.parameters"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"


def test_wrong_api_key_is_401(server):
    bad = openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert httpx.get(server.base_url + "/models").status_code == 401
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401  # vLLM's extras too


def test_malformed_json_and_content_type(server):
    r = post(server, "/completions", None, content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = post(
        server,
        "/completions",
        None,
        content=b"prompt=hi",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content_type"
    r = post(server, "/completions", [1, 2])
    assert r.status_code == 400 and "error" in r.json()


def test_what_vllm_clients_leave_out_is_filled_in(server):
    """As vLLM: a request that names no model asks for the served one, and a body sent without a
    Content-Type (Python's `requests.post(url, data=json.dumps(...))`) is read as JSON."""
    for path, body in (
        ("/completions", {"prompt": "Hello", "max_tokens": 3}),
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    ):
        r = post(server, path, body)
        assert r.status_code == 200 and r.json()["model"] == "tiny", r.text
        raw = httpx.post(
            server.base_url + path,
            content=json.dumps({"model": "tiny", **body}).encode(),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": ""},
            timeout=60,
        )
        assert raw.status_code == 200 and raw.json()["choices"], raw.text
        # Not from a web page: a browser sends a binary body so, without a preflight.
        page = {"Authorization": f"Bearer {KEY}", "Content-Type": "", "Origin": "https://page.example"}
        raw = httpx.post(server.base_url + path, content=json.dumps({"model": "tiny", **body}).encode(), headers=page)
        assert raw.status_code == 400 and raw.json()["error"]["code"] == "unsupported_content_type"
    r = post(server, "/completions", {"model": None, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "tiny"


def test_no_web_origin_may_call_by_default(server):
    """Without --allowed-origins no page a user visits can spend a local server's compute."""
    ask = {"Origin": "https://page.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(server.base_url + "/completions", headers=ask)
    assert r.status_code == 401 and "access-control-allow-origin" not in r.headers  # the preflight is not answered


def test_server_stays_healthy_after_bad_requests(server, client):
    assert server.health()[0] == 200
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=4, **FAST).choices[0].finish_reason


# ---- ops endpoints -------------------------------------------------------------------------------
def test_health_lists_workers(server):
    status, body = server.health()
    assert status == 200 and body["status"] == "ok"
    assert [w["alive"] for w in body["workers"]] == [True, True]


def test_metrics(server):
    m = server.metrics()
    assert m['cde_worker_up{worker="worker-0"}'] == 1 and m['cde_worker_up{worker="worker-1"}'] == 1
    for name in (
        "cde_worker_running_requests",
        "cde_worker_waiting_requests",
        "cde_worker_kv_pages_used",
        "cde_kv_pages_free",
        "cde_steps_per_second",
        "cde_time_to_first_block_seconds_count",
        "cde_inter_block_latency_seconds_count",
        "cde_e2e_request_latency_seconds_count",
        "cde_prompt_tokens_total",
        "cde_generation_tokens_total",
    ):
        assert name in m, name
    assert m["cde_generation_tokens_total"] > 0 and m["cde_e2e_request_latency_seconds_count"] > 0


def test_openapi(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    assert "/v1/completions" in doc["paths"] and "/v1/chat/completions" in doc["paths"]
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "steering", "attribution", "tokens_per_step"} <= set(props)
    # The served name, or none (null or left out): the served model, as the server reads it.
    assert props["model"]["anyOf"] == [{"type": "string", "enum": ["tiny"]}, {"type": "null"}]
