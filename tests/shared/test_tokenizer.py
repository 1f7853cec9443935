"""shared/tokenizer.py: Steerling specials, round trips, equality with the official tokenizer,
no network, chat template."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cde.shared.tokenizer import Tokenizer, get_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "The key to understanding neural networks is",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🤖🧠 and Ελληνικά",
    "  leading spaces\n\ttabs\r\nand\n\nnewlines  ",
    "code: def f(x):\n    return x ** 2  # 🔥",
    "<|mask|> and <|eot_id|> typed by a user are text",
    "",
]


@pytest.fixture(scope="module")
def official():
    from tests.oracle import offline_tiktoken_cache

    offline_tiktoken_cache()
    from steerling.data.tokenizer import SteerlingTokenizer

    return {False: SteerlingTokenizer(instruct=False), True: SteerlingTokenizer(instruct=True)}


def test_special_ids():
    base, inst = Tokenizer(), Tokenizer(instruct=True)
    for tok in (base, inst):
        ids = {
            s: tok.enc.encode_single_token(s)
            for s in ("<|pad|>", "<|bos|>", "<|endofchunk|>", "<|mask|>", "<|endoftext|>")
        }
        assert ids == {
            "<|pad|>": 100277,
            "<|bos|>": 100278,
            "<|endofchunk|>": 100279,
            "<|mask|>": 100280,
            "<|endoftext|>": 100257,
        }
        assert (tok.pad_id, tok.mask_id, tok.eos_id) == (100277, 100280, 100257)
    assert [inst.enc.encode_single_token(s) for s in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")] == [
        100281,
        100282,
        100283,
    ]
    assert inst.eot_id == 100283 and base.eot_id is None
    assert (base.vocab_size, inst.vocab_size) == (100281, 100284)
    with pytest.raises(KeyError):
        base.enc.encode_single_token("<|eot_id|>")


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(text):
    tok = get_tokenizer(False)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode()


def test_multibyte_split_across_tokens():
    tok = get_tokenizer(False)
    ids = tok.encode("🤖")
    assert len(ids) > 1  # one character, several byte-level tokens
    assert tok.decode_bytes(ids[:1]) != "🤖".encode() and tok.decode(ids) == "🤖"
    assert "\ufffd" in tok.decode(ids[:1])  # a partial character decodes as a replacement char


def test_user_text_never_becomes_special():
    tok = get_tokenizer(True)
    ids = tok.encode("<|mask|><|eot_id|><|endoftext|>")
    assert not set(ids) & {100257, 100280, 100283}
    assert tok.decode(ids) == "<|mask|><|eot_id|><|endoftext|>"


def test_decode_skips_steerling_specials():
    tok = get_tokenizer(True)
    hello = tok.encode("hello")
    noisy = [100278, *hello, 100280, 100277, 100279, 100257, 100281, 100282, 100283]
    assert tok.decode(noisy) == "hello"


@pytest.mark.parametrize("instruct", [False, True])
def test_equals_official_tokenizer(official, instruct):
    ref, ours = official[instruct], get_tokenizer(instruct)
    assert ours.vocab_size == ref.vocab_size
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=True)[1:-1]
        specials = [ref.bos_token_id, *ids, ref.mask_token_id, ref.eos_token_id, 100258]
        if instruct:
            specials += [ref.eot_id, ref.start_header_id]
        assert ours.decode(specials) == ref.decode(specials)


def test_works_without_network(tmp_path):
    """A fresh process with sockets disabled and an empty tiktoken cache still tokenizes."""
    code = (
        "import socket\n"
        "def no_net(*a, **k): raise OSError('network disabled in this test')\n"
        "socket.socket = no_net; socket.create_connection = no_net; socket.getaddrinfo = no_net\n"
        "from cde.shared.tokenizer import Tokenizer\n"
        "t = Tokenizer(instruct=True)\n"
        "ids = t.encode('offline héllo')\n"
        "assert t.decode(ids) == 'offline héllo', ids\n"
        "print(len(ids))\n"
    )
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty"), "DATA_GYM_CACHE_DIR": str(tmp_path / "empty2")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 0


def test_chat_template_layout():
    tok = get_tokenizer(True)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}]
    ids = tok.chat_prompt(msgs)
    e = tok.encode
    expected = (
        [100281, *e("system"), 100282, *e("\n\n"), *e("Be brief."), 100283]
        + [100281, *e("user"), 100282, *e("\n\n"), *e("Hi 👋"), 100283]
        + [100281, *e("assistant"), 100282, *e("\n\n")]
    )
    assert ids == expected
    # the same layout as the text template with the specials allowed
    text = (
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi 👋<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert ids == tok.enc.encode(text, allowed_special="all")


@pytest.mark.parametrize("content", ["\nHello", "\n\n```py\nx = 1\n```", " \n\tindented", "\r\nY", ""])
def test_chat_template_content_opening_with_whitespace(official, content):
    """The header's blank line and the content are one text between specials, as the official
    tokenizer reads the rendered template: a content that opens with newlines merges with it."""
    text = (
        f"<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    want = official[True]._tokenizer.encode(text, allowed_special="all")
    assert get_tokenizer(True).chat_prompt([{"role": "user", "content": content}]) == want


def test_chat_needs_instruct():
    with pytest.raises(ValueError, match="instruct"):
        get_tokenizer(False).chat_prompt([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("instruct", [False, True])
def test_ids_without_text_decode_to_nothing(instruct):
    # In the model's vocabulary but neither a BPE rank nor a special: a random model samples them.
    tok = get_tokenizer(instruct)
    hi = tok.encode(" hi")
    assert tok.decode([*hi, 100256, 100272, *hi]) == " hi hi"
