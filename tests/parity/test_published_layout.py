"""The published layout end to end. A checkpoint laid out exactly as `guidelabs/steerling-8b`
(config.json key for key: model_type "steerling", auto_map, architectures, ...; the published
tensor names, the tied lm_head absent; shapes shrunk) decodes token for token like the official
generator (float32 CPU): from its directory, and by Hub id from an offline Hugging Face cache
through `cde generate`; the instruct variant through the chat template of a real `cde serve
--model org/name`, read with the `openai` client."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import openai
import pytest
import torch
from cde.shared.config import EOT_ID

from tests.api_server import REPO, ServerProcess
from tests.hub_cache import cache_repo
from tests.parity.test_attribution_parity import WORDS, ours, reference, text_prompt
from tests.published import published, published_instruct, write_published

pytestmark = [pytest.mark.reference, pytest.mark.slow]

BASE_ID, INSTRUCT_ID = "guidelabs-test/steerling-tiny", "guidelabs-test/steerling-tiny-instruct"
N_NEW = 64


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    base = write_published(root / "base", published(), seed=11)
    instruct = write_published(root / "instruct", published_instruct(), seed=12)
    cache_repo(root / "hf", BASE_ID, base, "1" * 40)
    cache_repo(root / "hf", INSTRUCT_ID, instruct, "2" * 40)
    return SimpleNamespace(base=base, instruct=instruct, env={"HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1"})


def test_base_decodes_like_official_by_directory_and_hub_id(hub):
    text, ids = text_prompt()
    out, _, attr = reference(hub.base, text, N_NEW, 1)  # the official attributor's greedy run
    want = out.tokens[len(ids) :].tolist()
    tokens, records = ours(hub.base, ids, N_NEW, 1)
    assert tokens == want
    # The published head reports topk_known (here 4) of the topk_known_features (8) it composes
    # features from, as the official head does: its reported ids, in its order.
    for r in records:
        assert [int(c[0]) for c in r["known"]] == attr.known_indices[0, r["position"]].tolist()
    assert len(records[0]["known"]) == 4
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "cde",
            "generate",
            "--model",
            BASE_ID,
            "--prompt-ids",
            ",".join(map(str, ids)),
            "--max-tokens",
            str(N_NEW),
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **hub.env},
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["token_ids"] == want


def chat_prompt(content: str) -> list[int]:
    """The instruct checkpoints' template as a string, tokenized by the official tokenizer with
    its special tokens recognised (independent of CDE's own chat template code)."""
    from steerling.data.tokenizer import SteerlingTokenizer

    from tests.oracle import offline_tiktoken_cache

    offline_tiktoken_cache()
    rendered = (
        f"<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    return SteerlingTokenizer(instruct=True)._tokenizer.encode(rendered, allowed_special="all")


def one_block_message() -> tuple[str, list[int]]:
    """A user message whose templated prompt is exactly one 64-token block: only then does the
    reference generator decode the same blocks as CDE (see the handbook, decoding semantics)."""
    words = WORDS.split()
    for n in range(1, 64):
        content = " ".join(words[i % len(words)] for i in range(n))
        ids = chat_prompt(content)
        if len(ids) == 64:
            return content, ids
    raise AssertionError("no message length gives a 64-token prompt")


def test_instruct_chat_served_by_hub_id(hub, monkeypatch):
    from steerling.configs.generation import GenerationConfig

    from tests.oracle import official_generator

    content, prompt = one_block_message()
    gen = official_generator(hub.instruct)
    cfg = GenerationConfig(
        max_new_tokens=N_NEW, steps=N_NEW, temperature=0, use_entropy_sampling=False, top_p=0, repetition_penalty=1
    )
    want = gen.generate_full(torch.tensor([prompt]), cfg).tokens[len(prompt) :].tolist()
    stopped = EOT_ID in want
    want = want[: want.index(EOT_ID)] if stopped else want  # <|eot_id|> ends the answer, unsent

    for key, value in hub.env.items():
        monkeypatch.setenv(key, value)
    server = ServerProcess(INSTRUCT_ID, workers=1)
    try:
        banner = next(line for line in server.output if line.startswith("CDE serving"))
        assert f"CDE serving {INSTRUCT_ID} (1 worker on CPU) at {server.url}/v1, playground {server.url}/" in banner
        assert " (ready in " in banner
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        # the id as given, as vLLM names it, and the model card's root: the checkpoint served
        assert [(m.id, m.root, m.parent) for m in client.models.list()] == [(INSTRUCT_ID, INSTRUCT_ID, None)]
        r = client.chat.completions.create(
            model=INSTRUCT_ID,
            messages=[{"role": "user", "content": content}],
            max_tokens=N_NEW,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
    finally:
        server.stop()
    choice = r.choices[0]
    assert r.prompt_token_ids == prompt  # on the response, where vLLM puts it
    assert choice.token_ids == want
    assert choice.finish_reason == ("stop" if stopped else "length")
