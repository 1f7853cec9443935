"""Compatibility with OpenAI and vLLM clients, on a real `cde serve` of the demo instruct model
(`cde-reference`, tests/api/conftest.py's shared `server`, whose `<|eot_id|>` ends its replies):
docs/api.md's compatibility table row by row, a history rebuilt with the openai SDK's
`model_dump()`, vLLM's POST /tokenize and /detokenize against the official tokenizer, model cards'
root/parent, chat prompt_token_ids on the response, and min_tokens, ignore_eos and logit_bias
through the openai client."""

from pathlib import Path

import httpx
import openai
import pytest
from cde.gateway.chat_schemas import ChatCompletionRequest
from cde.gateway.schemas import CompletionRequest
from cde.shared.config import END_HEADER_ID, EOT_ID, START_HEADER_ID
from openai.types.chat import ChatCompletionMessage

from tests.api_server import REPO
from tests.oracle import offline_tiktoken_cache

MODEL = "cde-reference"
ASK = [{"role": "user", "content": "Reverse the order of these words: ice key map cloud"}]  # a short reply


@pytest.fixture(scope="module")
def official():
    """The official package's tokenizer: the independent reference for /tokenize."""
    offline_tiktoken_cache()
    from steerling.data.tokenizer import SteerlingTokenizer

    return SteerlingTokenizer(instruct=True)


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=120)


def test_model_card_root_and_parent(client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.parent is None
    assert (Path(card.root) / "config.json").is_file()  # the checkpoint served, as vLLM's root


@pytest.mark.parametrize("special", [True, False])
def test_tokenize_prompt_is_the_official_encoding(server, official, special):
    text = "Tokenize me: naïve café 🌊, 12345."
    r = post(server, "/tokenize", {"prompt": text, "add_special_tokens": special, "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    want = official.encode(text, add_special_tokens=special)
    assert out["tokens"] == want and out["count"] == len(want)
    assert out["max_model_len"] == httpx.get(server.base_url + "/models").json()["data"][0]["max_model_len"]
    assert len(out["token_strs"]) == len(want) and "".join(out["token_strs"][1 if special else 0 :]).startswith("Tok")
    # the default is vLLM's: add_special_tokens true for a prompt
    assert post(server, "/tokenize", {"prompt": text}).json()["tokens"] == official.encode(text)
    assert "token_strs" not in post(server, "/tokenize", {"prompt": text}).json()


def test_tokenize_messages_is_the_chat_template(server, client, official):
    enc = lambda s: official.encode(s, add_special_tokens=False)
    turn = [START_HEADER_ID, *enc("user"), END_HEADER_ID, *enc("\n\n"), *enc(ASK[0]["content"]), EOT_ID]
    reply = [START_HEADER_ID, *enc("assistant"), END_HEADER_ID, *enc("\n\n")]
    cases = [
        ({}, turn + reply),
        ({"add_generation_prompt": False}, turn),
        ({"add_generation_prompt": False, "continue_final_message": True}, turn[:-1]),
    ]
    for extra, want in cases:
        r = post(server, "/tokenize", {"model": MODEL, "messages": ASK, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == want and r.json()["count"] == len(want), extra
    # what the chat route feeds the model, on the response where vLLM puts it
    chat = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=2, temperature=0, extra_body={"return_token_ids": True}
    )
    assert chat.prompt_token_ids == turn + reply
    assert not hasattr(chat.choices[0], "prompt_token_ids") or chat.choices[0].prompt_token_ids is None
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=2, temperature=0, stream=True, extra_body={"return_token_ids": True}
    )
    chunks = list(stream)
    assert chunks[0].prompt_token_ids == turn + reply
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])


def test_chat_continues_the_final_message(server, client, official):
    """vLLM's add_generation_prompt and continue_final_message on the chat route: the prompt's ids
    by the template, against the official tokenizer; the answer is the continuation alone; the two
    flags together, or the continuation under a grammar, a 400 naming continue_final_message."""
    enc = lambda s: official.encode(s, add_special_tokens=False)
    user = [START_HEADER_ID, *enc("user"), END_HEADER_ID, *enc("\n\n"), *enc(ASK[0]["content"]), EOT_ID]
    started = [START_HEADER_ID, *enc("assistant"), END_HEADER_ID, *enc("\n\n"), *enc("The key")]
    messages = [*ASK, {"role": "assistant", "content": "The key"}]

    def chat(**flags):
        extra = {"return_token_ids": True, **flags}
        return client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body=extra
        )

    cont = chat(add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt_token_ids == user + started
    choice = cont.choices[0]
    assert choice.token_ids and choice.message.content == official.decode(choice.token_ids)
    assert chat(add_generation_prompt=False).prompt_token_ids == user + started + [EOT_ID]
    tokenized = post(
        server, "/tokenize", {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    )
    assert tokenized.json()["tokens"] == user + started
    for body in (
        {"continue_final_message": True},
        {"add_generation_prompt": False, "continue_final_message": True, "response_format": {"type": "json_object"}},
    ):
        r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_detokenize_is_the_official_decoding(server, official):
    ids = official.encode("A round trip: 🌊 and <|eot_id|> as text.", add_special_tokens=False) + [EOT_ID]
    r = post(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": official.decode(ids, skip_special_tokens=False)}
    assert r.json()["prompt"].endswith("as text.<|eot_id|>")


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/detokenize", {"tokens": [5, 999_999_999]}, 400, "tokens"),
        ("/detokenize", {"tokens": [5] * 100_000}, 400, "tokens"),
        ("/detokenize", {"tokens": "hello"}, 400, "tokens"),
        ("/detokenize", {"model": "gpt-4", "tokens": [5]}, 404, "model"),
        ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"prompt": "x", "chat_template": "{{ x }}"}, 400, "chat_template"),
        ("/tokenize", {"messages": ASK, "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"prompt": "x" * 3_000_000}, 400, "prompt"),  # refused untokenized
        ("/tokenize", {"prompt": "hello " * 5000}, 400, "prompt"),  # more ids than the context
        ("/tokenize", {"messages": [{"role": "user", "content": "hello " * 5000}]}, 400, "messages"),
    ],
)
def test_tokenizer_routes_refuse_bad_input(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    if len(str(body)) > 30_000:  # past the context, on either route (docs/api.md)
        assert r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_verbosity_is_refused_for_its_own_reason(server):
    r = post(server, "/v1/chat/completions", body_for("chat/completions", SAMPLES["verbosity"]))
    assert r.status_code == 400 and "reasoning" not in r.json()["error"]["message"], r.text


def reply_ids(client, **extra):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        temperature=0,
        extra_body={"return_token_ids": True, **extra.pop("extra", {})},
        **extra,
    )
    return r.choices[0], r.usage.completion_tokens


def test_ignore_eos_and_min_tokens(client):
    plain, n = reply_ids(client, max_tokens=40)
    assert plain.finish_reason == "stop" and n == len(plain.token_ids) < 30  # EOT ended the reply
    ignored, m = reply_ids(client, max_tokens=n + 10, extra={"ignore_eos": True})
    assert ignored.finish_reason == "length" and m == len(ignored.token_ids) == n + 10
    assert EOT_ID in ignored.token_ids  # EOT came and did not end it
    longer, k = reply_ids(client, max_tokens=n + 20, extra={"min_tokens": n + 5})
    assert k >= n + 5 and EOT_ID not in longer.token_ids


def test_logit_bias_bans_and_names_a_bad_key(client):
    plain, _ = reply_ids(client, max_tokens=40)
    first = plain.token_ids[0]
    banned, _ = reply_ids(client, max_tokens=40, logit_bias={str(first): -100})
    assert first not in banned.token_ids
    with pytest.raises(openai.BadRequestError) as e:
        reply_ids(client, max_tokens=4, logit_bias={"99999999": 5})
    assert e.value.body["param"] == "logit_bias.99999999"


# ---- the compatibility table (docs/api.md) ----------------------------------------------------------
def table_rows(heading: str) -> list[list[str]]:
    """The rows of the first table after `heading` in docs/api.md, cells stripped of backticks."""
    text = (REPO / "docs" / "api.md").read_text()
    lines = text[text.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| field"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().strip("`") for c in line.strip("|").split("|")])
    return rows


OPENAI_ROWS = table_rows("## Compatibility with the OpenAI API")
EXTENSION_ROWS = table_rows("CDE and vLLM extensions")
DROP = object()  # a sample value that removes the base body's field

# A value each row's field is sent with (several fields where one needs another).
SAMPLES = {
    "model": {},
    "messages": {},
    "prompt": {},
    "max_tokens": {"max_tokens": 3},
    "max_completion_tokens": {"max_tokens": DROP, "max_completion_tokens": 3},
    "temperature": {"temperature": 0.7, "seed": 1},
    "top_p": {"top_p": 0.5},
    "n": {"n": 2},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
    "stop": {"stop": ["\n"]},
    "seed": {"seed": 5},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "presence_penalty": {"presence_penalty": -0.5},
    "logit_bias": {"logit_bias": {"5": 1.5}},
    "echo": {"echo": True},
    "user": {"user": "user-1"},
    "metadata": {"metadata": {"team": "search", "run": "7"}},
    "store": {"store": True},
    "service_tier": {"service_tier": "flex"},
    "prompt_cache_key": {"prompt_cache_key": "k1"},
    "safety_identifier": {"safety_identifier": "hashed-user"},
    "prompt_cache_options": {"prompt_cache_options": {"mode": "explicit", "ttl": "30m"}},
    "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "prediction": {"prediction": {"type": "content", "content": "cloud map key ice"}},
    "modalities": {"modalities": ["text"]},
    "suffix": {"suffix": "the end"},
    "best_of": {"n": 1, "best_of": 3},
    "functions": {"functions": [{"name": "f", "parameters": {"type": "object"}}]},
    "function_call": {"function_call": "auto"},
    "audio": {"audio": {"voice": "alloy", "format": "wav"}},
    "web_search_options": {"web_search_options": {}},
    "reasoning_effort": {"reasoning_effort": "low"},
    "verbosity": {"verbosity": "low"},
}
# Rows other work of issue 26 implements (structured outputs, tool calls, logprobs): their own
# test files exercise them; this file checks only that they have a row and a schema field.
ELSEWHERE = {"logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls"}


def body_for(endpoint: str, extra: dict) -> dict:
    base = {"model": MODEL, "max_tokens": 2, "temperature": 0, "return_token_ids": True}
    base |= {"messages": ASK} if endpoint == "chat/completions" else {"prompt": "Reverse: ice key"}
    base |= extra
    return {k: v for k, v in base.items() if v is not DROP}


def cases():
    for field, endpoints, status, _ in OPENAI_ROWS:
        for endpoint in ("chat/completions", "completions"):
            if endpoints in ("both", endpoint.split("/")[0]):
                yield pytest.param(field, endpoint, status, id=f"{endpoint}:{field}")


@pytest.mark.slow
@pytest.mark.parametrize("field, endpoint, status", cases())
def test_the_table_row_is_what_the_server_does(server, field, endpoint, status):
    if field in ELSEWHERE:
        assert status == "supported"
        return
    r = post(server, "/v1/" + endpoint, body_for(endpoint, SAMPLES[field]))
    if status == "refused":  # OpenAI's codes: the field refused by name; best_of refused unless it is n
        code = "unsupported_value" if field == "best_of" else "unsupported_parameter"
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert r.json()["error"]["code"] == code, r.text
        return
    assert r.status_code == 200, r.text
    if status == "accepted, ignored":  # the same tokens as without the field
        without = post(server, "/v1/" + endpoint, body_for(endpoint, {})).json()
        assert [c["token_ids"] for c in r.json()["choices"]] == [c["token_ids"] for c in without["choices"]]
    else:
        assert status == "supported", status


def test_every_field_has_a_row_and_every_row_a_field():
    documented = {row[0] for row in OPENAI_ROWS} | {row[0] for row in EXTENSION_ROWS}
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    assert fields - documented == set(), "schema fields without a row in docs/api.md"
    assert documented - fields - ELSEWHERE == set(), "rows of docs/api.md the schema does not know"
    assert {row[2] for row in OPENAI_ROWS} == {"supported", "accepted, ignored", "refused"}
    assert set(SAMPLES) | ELSEWHERE == {row[0] for row in OPENAI_ROWS}


def test_a_history_rebuilt_with_model_dump_changes_nothing(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0)
    message = first.choices[0].message
    assert isinstance(message, ChatCompletionMessage)
    follow = {"role": "user", "content": "And again."}
    dumped = message.model_dump()  # refusal, annotations, audio, function_call, tool_calls: null
    assert {"refusal", "annotations", "audio", "function_call", "tool_calls"} <= set(dumped)
    cited = ChatCompletionMessage(
        role="assistant",
        content=message.content,
        refusal="I can't help with that.",
        annotations=[
            {"type": "url_citation", "url_citation": {"start_index": 0, "end_index": 1, "title": "t", "url": "u"}}
        ],
    ).model_dump()
    plain = {"role": "assistant", "content": message.content}

    def ids(history):
        r = client.chat.completions.create(
            model=MODEL, messages=history, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
        )
        return r.prompt_token_ids, r.choices[0].token_ids

    want = ids([*ASK, plain, follow])
    assert ids([*ASK, dumped, follow]) == want
    assert ids([*ASK, cited, follow]) == want
    # the reply fields belong to assistant messages; a non-null audio is not a dumped reply
    for bad, param in (
        ({**ASK[0], "refusal": "no"}, "messages.0"),
        ({**dumped, "audio": {"id": "a1"}}, "messages.1.audio"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[*ASK[:1], bad] if param != "messages.0" else [bad])
        assert e.value.body["param"] == param, e.value.body


def test_null_is_the_default_of_every_field_that_has_one(server):
    """The OpenAI SDK types these nullable and wrappers pass None through for "not set": null is
    the field's default, the same tokens as without it (seeded at the default temperature)."""
    nulls = dict.fromkeys(["temperature", "top_p", "n", "stream", "top_k", "repetition_penalty", "min_tokens"])
    nulls |= dict.fromkeys(["ignore_eos", "tokens_per_step", "include_stop_str_in_output", "return_token_ids"])
    nulls["model"] = None  # the served model, as vLLM
    for endpoint, own in (
        ("chat/completions", ["parallel_tool_calls", "add_generation_prompt"]),
        ("completions", ["echo"]),
    ):
        plain = body_for(endpoint, {"seed": 3, "temperature": DROP})
        r = post(server, "/v1/" + endpoint, plain | nulls | dict.fromkeys(own) | {"return_token_ids": True})
        assert r.status_code == 200, r.text
        assert (
            r.json()["choices"][0]["token_ids"]
            == post(server, "/v1/" + endpoint, plain).json()["choices"][0]["token_ids"]
        )
    r = post(server, "/v1/chat/completions", body_for("chat/completions", {"messages": None}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"  # a required field is no default


def test_completions_max_tokens_null_is_until_the_context(server):
    """vLLM's reading of a null max_tokens: whatever the context leaves after the prompt (OpenAI's
    field is nullable; its default, 16, is for an absent one)."""
    context = post(server, "/tokenize", {"prompt": "x"}).json()["max_model_len"]
    word = post(server, "/tokenize", {"prompt": " ice", "add_special_tokens": False}).json()["tokens"]
    body = {"model": MODEL, "prompt": word * (context - 3), "max_tokens": None, "temperature": 0, "ignore_eos": True}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["finish_reason"] == "length"
    r = post(server, "/v1/completions", {**body, "prompt": word * context})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_seeds_count_all_64_bits(server):
    """Seeds that differ only above bit 31 sample differently; -1 and 2**64 - 1 are one 64-bit seed."""

    def tokens(seed: int) -> list[int]:
        body = body_for("chat/completions", {"temperature": 2.0, "seed": seed, "max_tokens": 8})
        r = post(server, "/v1/chat/completions", body | {"messages": [{"role": "user", "content": "Write a story."}]})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    for low in (0, 1, 2):
        assert tokens(low) != tokens(low + (1 << 32)) and tokens(low) == tokens(low)
    assert tokens(-1) == tokens((1 << 64) - 1) != tokens((1 << 63) - 1)


def test_content_parts_are_lines_and_a_refusal_part_is_its_text(server):
    """Text parts join with a newline (vLLM's), so two parts are not one run-on word; an assistant
    message's refusal part is its text (vLLM's), and belongs to assistant messages only."""

    def tokens(messages):
        r = post(server, "/tokenize", {"model": MODEL, "messages": messages})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    breakpoint = {"prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}  # OpenAI's hint: ignored
    parts = [{"type": "text", "text": "Reverse these words:", **breakpoint}, {"type": "text", "text": "ice key"}]
    assert tokens([{"role": "user", "content": parts}]) == tokens(
        [{"role": "user", "content": "Reverse these words:\nice key"}]
    )
    refused = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}
    assert tokens([*ASK, refused]) == tokens([*ASK, {"role": "assistant", "content": "I can't."}])
    r = post(server, "/v1/chat/completions", body_for("chat/completions", {"messages": [{**refused, "role": "user"}]}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0", r.text
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    r = post(server, "/v1/chat/completions", body_for("chat/completions", {"messages": [image]}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.0", r.text
    assert "of type 'image_url'" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == "unsupported_value", r.text  # refused by name, as a field is
    # a text part's own fields by their path: no union member's tag in it
    for part, param in (({"type": "text"}, "text"), ({"type": "text", "text": "a", "x": 1}, "x")):
        r = post(
            server, "/v1/chat/completions", body_for("chat/completions", {"messages": [{**ASK[0], "content": [part]}]})
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == f"messages.0.content.0.{param}", r.text


def test_a_stream_a_stop_string_ends_early_reports_its_cached_prompt(client):
    """A stop found in a streamed prefix ends the choice before its block's result: the usage's
    cached_tokens still counts the prompt pages the prefix cache held."""
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 30}, *ASK]
    kw = dict(model=MODEL, messages=messages, max_tokens=48, temperature=0)
    client.chat.completions.create(**kw)  # writes the prompt's pages
    again = client.chat.completions.create(**kw)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64
    stop = again.choices[0].message.content[2:6]
    chunks = list(client.chat.completions.create(**kw, stop=stop, stream=True, stream_options={"include_usage": True}))
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_unknown_fields_are_still_refused_by_name(server):
    for endpoint in ("chat/completions", "completions"):
        r = post(server, "/v1/" + endpoint, body_for(endpoint, {"frobnicate": 1}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
        assert r.json()["error"]["code"] == "unsupported_parameter"
    r = post(server, "/v1/chat/completions", body_for("chat/completions", {"stream": True, "stream_options": {"x": 1}}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.x"


@pytest.mark.parametrize(
    "extra",
    [
        {"skip_special_tokens": True},
        {"min_p": 0},
        {"reasoning_effort": "none"},
        {"service_tier": "fast"},
        {"top_logprobs": 0},  # without logprobs: asks for nothing (vLLM refuses above 0 only)
        {"messages": [{**ASK[0]}, {"role": "assistant", "content": "ok", "reasoning_content": None}, ASK[0]]},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": None}}},
    ],
    ids=[
        "skip_special_tokens",
        "min_p",
        "reasoning_effort",
        "service_tier",
        "top_logprobs",
        "reasoning_content",
        "schema",
    ],
)
def test_what_clients_send_that_changes_nothing_is_accepted(server, extra):
    """Values real clients send (vLLM's defaults, the openai SDK's newer enums, a vLLM reply's
    null reasoning in a history, a pydantic dump's null schema) answer as without them."""
    # the same history without the null field: only the field differs between the two requests
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in extra.get("messages", [])]
    base = body_for("chat/completions", {"messages": plain} if plain else {})
    if "response_format" in extra:  # its default, an empty schema: any JSON value
        base["response_format"] = {"type": "json_schema", "json_schema": {"name": "x"}}
    r = post(server, "/v1/chat/completions", {**base, **extra})
    assert r.status_code == 200, r.text
    without = post(server, "/v1/chat/completions", base).json()
    assert r.json()["choices"][0]["token_ids"] == without["choices"][0]["token_ids"]


@pytest.mark.parametrize("extra", [{"skip_special_tokens": False}, {"min_p": 0.1}, {"reasoning_effort": "low"}])
def test_what_would_change_the_output_is_refused_by_name(server, extra):
    r = post(server, "/v1/chat/completions", body_for("chat/completions", extra))
    (field,) = extra
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert r.json()["error"]["code"] == "unsupported_parameter", r.text
