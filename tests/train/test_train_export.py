"""Export: the trained model as a CDE checkpoint in the published layout (CDE's loader and
engine take it unchanged), its archive, the install into CDE_HOME, and the way back."""

import json

import pytest
import torch
from cde.shared.protocol import GenerateRequest
from cde.worker.checkpoint import load_checkpoint

from cde.train.export import archive, export, install, load
from cde.train.program import model_config
from cde.train.token_set import used_ids
from cde.train.train_model import TrainModel, block_causal_mask


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = TrainModel(model_config("mini"), used_ids(sample_docs=500))
    return model, export(model, tmp_path_factory.mktemp("export") / "model", torch.float32)


def test_checkpoint_is_the_published_layout_with_zero_unused_rows(exported):
    model, path = exported
    cfg, loaded = load_checkpoint(path)  # strict: every tensor, exact shapes
    assert cfg.instruct and cfg.vocab_size == 100284 and cfg.n_concepts == model.cfg.n_concepts
    raw = json.loads((path / "config.json").read_text())
    assert raw["n_layers"] == 2 and "concept" not in raw  # flat, as published
    emb = loaded.transformer.tok_emb.weight
    nonzero = emb.abs().sum(-1) > 0
    assert nonzero.sum() == model.n_used and nonzero[model.used].all()
    assert (path / "concept_labels.parquet").is_file()


def test_engine_loads_and_decodes_it(exported):
    from cde.worker.engine import Engine, EngineArgs

    _, path = exported
    engine = Engine(EngineArgs(str(path), max_running=2))
    prompt = engine.tokenizer.chat_prompt([{"role": "user", "content": "What is 1 2 3 + 4 5 6?"}])
    out = engine.generate([GenerateRequest("a", prompt, max_tokens=8)])
    assert len(out["a"]) == 8


def test_archive_installs_once_and_loads_back(exported, tmp_path):
    model, path = exported
    packed = archive(path, tmp_path / "model.tar.xz")
    raw = sum(f.stat().st_size for f in path.iterdir())
    assert packed.stat().st_size < raw / 4  # the zero rows cost nothing
    home = tmp_path / "home"
    dest = install(packed, home, "reference")
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in path.iterdir())
    (dest / "marker").write_text("kept")
    assert install(packed, home, "reference") == dest and (dest / "marker").is_file()  # not unpacked again
    back = load(dest)
    assert torch.equal(back.used, model.used)
    ids = model.used[:70][None]
    pos, mask = torch.arange(70)[None], block_causal_mask(torch.zeros_like(ids))
    with torch.no_grad():
        torch.testing.assert_close(back.hidden(ids, pos, mask), model.eval().hidden(ids, pos, mask))
