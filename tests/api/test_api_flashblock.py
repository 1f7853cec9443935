"""FlashBlock through the API, real `cde serve` processes and the openai client: the server flag
sets the default, `"flashblock"` in the body overrides it per request, and a bad value is a 400
naming the field."""

import openai
import pytest

from tests.api_server import ServerProcess

PROMPT = "The history of the lighthouse"


@pytest.fixture(scope="module")
def servers(tiny_instruct_dir, tiny_chat_server):
    exact = tiny_chat_server  # no --flashblock flags: exact attention by default
    # server default: FlashBlock with reuse on every step it can
    reusing = ServerProcess(
        tiny_instruct_dir,
        "--served-model-name",
        "tiny",
        "--flashblock-tau",
        "2",
        "--flashblock-max-reuse",
        "63",
        workers=1,
    )
    yield {
        name: openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)
        for name, srv in (("exact", exact), ("reusing", reusing))
    }
    reusing.stop()


def complete(client, **extra) -> str:
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=140, temperature=0, extra_body=extra)
    assert out.choices[0].finish_reason == "length"
    return out.choices[0].text


def test_flag_default_and_per_request_override(servers):
    exact = complete(servers["exact"])
    # split attention without reuse, asked per request: exact
    assert complete(servers["exact"], flashblock={"tau": 0, "max_reuse": 0}) == exact
    # the reusing server's default changes the output; `false` restores the exact path
    reusing = complete(servers["reusing"])
    assert reusing != exact
    assert complete(servers["reusing"], flashblock=False) == exact
    assert complete(servers["exact"], flashblock={"tau": 2, "max_reuse": 63}) == reusing


def test_bad_flashblock_is_a_400_naming_the_field(servers):
    with pytest.raises(openai.BadRequestError) as err:
        complete(servers["exact"], flashblock={"tau": -1})
    assert err.value.body["param"].startswith("flashblock")
