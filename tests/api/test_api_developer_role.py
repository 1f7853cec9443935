"""OpenAI's `developer` role is the system prompt of newer models: the chat template must render it
as a `system` turn (the template has no `developer` header), through a real `cde serve` and the
`openai` client. The expected prompt is the published Llama-3-style template written out here."""

import openai
import pytest
from cde.shared.config import END_HEADER_ID, EOT_ID, START_HEADER_ID
from cde.shared.tokenizer import get_tokenizer

INSTRUCTION, QUESTION = "Answer in French.", "What is the capital of Peru?"


@pytest.fixture(scope="module")
def client(tiny_chat_server):
    return openai.OpenAI(base_url=tiny_chat_server.base_url, api_key="none", max_retries=0, timeout=60)


def template(turns: list[tuple[str, str]]) -> list[int]:
    encode = get_tokenizer(True).encode
    header = lambda role: [START_HEADER_ID, *encode(role), END_HEADER_ID, *encode("\n\n")]
    ids = [t for role, text in turns for t in [*header(role), *encode(text), EOT_ID]]
    return ids + header("assistant")


def prompt_ids(client, first_role: str) -> list[int]:
    messages = [{"role": first_role, "content": INSTRUCTION}, {"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=1, extra_body={"return_token_ids": True}
    )
    return r.model_extra["prompt_token_ids"]


def test_developer_is_rendered_as_system(client):
    expected = template([("system", INSTRUCTION), ("user", QUESTION)])
    assert prompt_ids(client, "developer") == expected
    assert prompt_ids(client, "system") == expected
