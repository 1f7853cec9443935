"""vLLM's extras on a real `cde serve` of the demo instruct model (`cde-reference`, whose
`<|eot_id|>` ends its replies): POST /tokenize and /detokenize against the official tokenizer,
model cards' root/parent, chat prompt_token_ids on the response, min_tokens, ignore_eos and
logit_bias through the openai client."""

from pathlib import Path

import httpx
import openai
import pytest
from cde.shared.config import END_HEADER_ID, EOT_ID, START_HEADER_ID

from tests.api_server import ServerProcess
from tests.oracle import offline_tiktoken_cache

MODEL = "cde-reference"
ASK = [{"role": "user", "content": "Reverse the order of these words: ice key map cloud"}]  # a short reply


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CDE_HOME", str(tmp_path_factory.mktemp("cde-home")))
        srv = ServerProcess(None, workers=1)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def official():
    """The official package's tokenizer: the independent reference for /tokenize."""
    offline_tiktoken_cache()
    from steerling.data.tokenizer import SteerlingTokenizer

    return SteerlingTokenizer(instruct=True)


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


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
        ("/tokenize", {"messages": ASK, "continue_final_message": True}, 400, None),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"prompt": "x" * 3_000_000}, 400, "prompt"),
    ],
)
def test_tokenizer_routes_refuse_bad_input(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


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
