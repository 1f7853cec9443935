"""The published layout of Steerling-8B (tests/fixtures, copied from the project's
../shared/fixtures): its config.json key for key, the instruct variant, and checkpoints in that
layout with the shapes shrunk."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from cde.shared.config import EOT_ID, INSTRUCT_VOCAB, ModelConfig
from safetensors import safe_open

FIXTURES = Path(__file__).resolve().parent / "fixtures"

# Small shapes; the known head still reports fewer concepts than it composes features from
# (published: 16 of 32), so the two top-k settings are told apart.
SHRUNK = dict(
    n_layers=2,
    n_head=4,
    n_kv_heads=2,
    n_embd=64,
    concept_dim=64,
    block_size=1024,
    n_concepts=96,
    n_unknown_concepts=256,
    factorize_rank=16,
    topk_known=4,
    topk_known_features=8,
    unknown_topk=16,
    concept_block_size=128,
)


def published() -> dict:
    """The published config.json of steerling-8b."""
    return json.loads((FIXTURES / "steerling-8b.config.json").read_text())


def published_instruct() -> dict:
    """The instruct variant: the chat header / end-of-turn ids and their vocabulary on top."""
    return {
        **published(),
        "instruct": True,
        "vocab_size": INSTRUCT_VOCAB,
        "start_header_token_id": 100281,
        "end_header_token_id": 100282,
        "eot_token_id": EOT_ID,
    }


def write_published(out: Path, raw: dict, seed: int) -> Path:
    """A random-weight checkpoint whose config.json has exactly the keys of `raw` (shapes
    shrunk), whose safetensors hold the published tensor names (the tied lm_head absent), with
    the published tokenizer_config.json beside them."""
    from cde.worker.checkpoint import TIED, random_model, save_checkpoint

    raw = {**raw, **SHRUNK}
    assert raw.keys() == published().keys() | (
        {"instruct", "start_header_token_id", "end_header_token_id", "eot_token_id"} if raw.get("instruct") else set()
    )
    cfg = ModelConfig.from_dict(raw)
    save_checkpoint(random_model(cfg, seed), cfg, out)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    shutil.copy(FIXTURES / "steerling-8b.tokenizer_config.json", out / "tokenizer_config.json")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert TIED not in f.keys()  # noqa: SIM118 -- safe_open has keys() but no __contains__
    return out
