"""Greedy decoding is token-for-token the official generator's (`generate_full`), float32 CPU.

The tiny checkpoint written by the official model classes runs the reference live; the tiny and
small checkpoints written by `cde make-model` compare against tokens recorded from the reference
by scripts/record_goldens.py (pinned to the checkpoint's SHA-256): a live reference run costs a
minute or more per prompt on CI's two cores."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from cde.shared.protocol import GenerateRequest
from cde.worker.engine import Engine, EngineArgs

pytestmark = pytest.mark.reference

PROMPT_LENGTHS = (64, 128, 192)
GOLDEN_SEEDS = {"tiny": 1, "small": 3}  # the tiny_dir and small_dir fixtures' seeds (tests/conftest.py)


def golden_path(preset: str) -> Path:
    return Path(__file__).parents[1] / "goldens" / f"parity_{preset}.json"


def reference_tokens(model_dir, prompt: list[int], max_new: int, per_step: int = 1) -> list[int]:
    from tests.oracle import greedy_config, official_generator

    gen = official_generator(model_dir)
    cfg = greedy_config(max_new, per_step)
    out = gen.generate_full(torch.tensor([prompt]), cfg)
    return out.tokens[len(prompt) :].tolist()


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 100000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def checkpoint_sha256(model_dir) -> str:
    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def _ours(model_dir, ps, lengths=(128, 256)) -> dict[str, list[int]]:
    engine = Engine(EngineArgs(str(model_dir)))
    reqs = [GenerateRequest(f"{i}-{n}", p, max_tokens=n) for i, p in enumerate(ps) for n in lengths]
    return engine.generate(reqs)


def test_greedy_matches_official_generator(tiny_official_dir):
    """Live: the reference recomputes the whole sequence at every step, so two blocks (the
    second one's context holds the first's commits) after a one-page prompt; four blocks and the
    longer prompts are the recorded goldens'."""
    p = prompts(seed=len("tiny_official_dir"))[0]
    ours = _ours(tiny_official_dir, [p], (64, 128))
    # Block-causal attention: the first 64 tokens of a 128-token run are the 64-token run.
    ref = reference_tokens(tiny_official_dir, p, 128)
    assert ours["0-128"] == ref
    assert ours["0-64"] == ref[:64]


# Per preset, the lengths the engine generates (each compared with the recorded 256's prefix):
# tiny four blocks, and the prefix property (a one-block run beside the four-block one of the same
# prompt, sharing its prompt pages and finishing first); small is the larger shape (GQA groups of
# four, width), two blocks of it, the cost of a step growing with its width and the requests in it.
LENGTHS = {"tiny": (64, 256), "small": (128,)}


@pytest.mark.parametrize("preset", sorted(GOLDEN_SEEDS))
def test_greedy_matches_recorded_official_tokens(preset, request):
    model_dir = request.getfixturevalue(f"{preset}_dir")
    golden = json.loads(golden_path(preset).read_text())
    assert golden["safetensors_sha256"] == checkpoint_sha256(model_dir), "re-record: scripts/record_goldens.py"
    ours = _ours(model_dir, golden["prompts"], LENGTHS[preset])
    for i, ref in enumerate(golden["tokens"]):
        for n in LENGTHS[preset]:
            assert ours[f"{i}-{n}"] == ref[:n]


@pytest.mark.parametrize("per_step", [4, 16])
def test_tokens_per_step_matches_the_official_linear_schedule(tiny_dir, per_step):
    """`tokens_per_step: k` is the official schedule of max_new_tokens / k steps (k tokens per
    step), over three generated blocks, so also the commits of the finished ones."""
    prompt = prompts(seed=5)[0]
    engine = Engine(EngineArgs(str(tiny_dir)))
    ours = engine.generate([GenerateRequest("k", prompt, max_tokens=192, tokens_per_step=per_step)])["k"]
    assert ours == reference_tokens(tiny_dir, prompt, 192, per_step)
