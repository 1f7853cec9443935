"""From a trained model to what CDE serves and what the package ships.

- export(): a checkpoint directory in the published layout (flat config.json, model.safetensors
  with `transformer.*`, `known_head.*`, `unknown_head.*`, tied LM head omitted) plus the concept
  catalog; the rows of unused ids are exact zeros.
- archive(): that directory as one .tar.xz (the zero rows compress to nothing).
- install(): unpack an archive into CDE_HOME once (serving code: `worker.demo_model`, which
  unpacks the shipped demo the same way).
- load(): a checkpoint directory back as a TrainModel (used rows = the non-zero rows), for the
  eval's interventions on the dense forward.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cde.shared.config import ModelConfig
from cde.train.reference_concepts import write_catalog
from cde.train.train_model import TrainModel
from cde.worker.demo_model import install  # noqa: F401  (re-exported: the train program's name for it)

EMB = "transformer.tok_emb.weight"


def published_state(model: TrainModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    full = torch.zeros(model.cfg.vocab_size, model.cfg.n_embd, dtype=dtype)
    full[model.used.cpu()] = state[EMB]
    state[EMB] = full
    return state


def export(model: TrainModel, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Written beside and renamed into place: a reader never sees half a checkpoint."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(model.cfg.to_published_dict(), indent=2))
    save_file(published_state(model, dtype), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    write_catalog(tmp / "concept_labels.parquet")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def archive(model_dir: str | Path, path: str | Path) -> Path:
    path = Path(path)
    with tarfile.open(path, "w:xz", preset=9) as tar:
        for f in sorted(Path(model_dir).iterdir()):
            tar.add(f, arcname=f.name)
    return path


def load(model_dir: str | Path, device: str = "cpu") -> TrainModel:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_json(model_dir / "config.json")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k).float() for k in f.keys()}  # noqa: SIM118 -- safe_open is not a dict: it has keys() but no __iter__
    used = state[EMB].abs().sum(-1).nonzero().flatten()
    state[EMB] = state[EMB][used]
    model = TrainModel(cfg, used.tolist())
    model.load_state_dict(state)
    return model.to(device).eval()
