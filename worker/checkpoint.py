"""Steerling checkpoints on disk: `config.json` + `*.safetensors` (single file or sharded with
`model.safetensors.index.json`), in the published layout. Load with strict validation, or write a
random-weight checkpoint of a preset shape (`cde make-model`, the tests' models)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from cde.shared.config import ConfigError, ModelConfig, preset
from cde.shared.weight_files import INDEX, unreadable, weight_files
from cde.worker.model import SteerlingModel
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

if TYPE_CHECKING:
    from tqdm.auto import tqdm

TIED = "transformer.lm_head.weight"
EMBEDDING = "transformer.tok_emb.weight"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STORED = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

log = logging.getLogger("cde.checkpoint")


class CheckpointError(ValueError):
    pass


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model directory {str(path)!r} does not exist")
    return ModelConfig.from_json(path / "config.json")


def _weight_files(path: Path) -> list[Path]:
    try:
        return weight_files(path)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def load_checkpoint(
    path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[ModelConfig, SteerlingModel]:
    """Returns (config, model in eval mode). Every tensor must be present with its exact shape:
    that is checked from the safetensors headers before any memory is allocated. The weights are
    then read straight onto `device` one tensor at a time (safetensors maps the file and copies to
    the GPU), never staged as a whole model in host memory."""
    path = Path(path)
    cfg = load_config(path)
    with torch.device("meta"):
        model = SteerlingModel(cfg)
    t0 = time.perf_counter()
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    plan = _plan(_weight_files(path), expected)
    names = set(plan)
    if cfg.weight_sharing and names & {TIED, EMBEDDING}:
        names |= {TIED, EMBEDDING}  # one tensor fills both
        if TIED in plan:  # both on disk: the LM head's, as the official loader ties the embedding to it
            plan.pop(EMBEDDING, None)
    missing = sorted(set(expected) - names)
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor(s): {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    # The stored dtype by default; float64 on disk loads as float32 (the official loader casts too).
    dtype = dtype or next(iter(plan.values()))[1]
    if dtype == torch.float64:
        dtype = torch.float32
    # Allocate in the target dtype directly: a bf16 8b model never exists in float32.
    model = model.to(dtype).to_empty(device=device)
    if cfg.weight_sharing:
        model.transformer.tok_emb.weight = model.transformer.lm_head.weight
    nbytes = sum(size for _, _, size in plan.values())
    state = model.state_dict()
    with torch.no_grad(), _progress(nbytes, "loading weights") as bar:
        for f in sorted({f for f, _, _ in plan.values()}):
            with safe_open(str(f), framework="pt", device=str(device)) as sf:
                for name in (n for n, (g, _, _) in plan.items() if g == f):
                    state[name].copy_(sf.get_tensor(name))
                    bar.update(plan[name][2])
    seconds = time.perf_counter() - t0
    log.info(
        "weights loaded in %.1f s (%.2f GB, %.2f GB/s) to %s",
        seconds,
        nbytes / 1e9,
        nbytes / 1e9 / seconds,
        device,
        extra={"load_s": round(seconds, 3), "bytes": nbytes},
    )
    return cfg, model.eval()


def _plan(files: list[Path], expected: dict[str, tuple]) -> dict[str, tuple[Path, torch.dtype, int]]:
    """name -> (file, stored dtype, bytes), from the headers alone; rejects what does not fit."""
    plan: dict[str, tuple[Path, torch.dtype, int]] = {}
    for f in files:
        with _opened(f) as sf:
            for name in sf.keys():  # noqa: SIM118 -- safe_open has keys() but no __iter__
                if name not in expected:
                    raise CheckpointError(f"{f.name}: unexpected tensor {name!r} (not part of this architecture)")
                if name in plan:  # which copy is meant is anyone's guess: the official loader takes the last
                    raise CheckpointError(f"tensor {name!r} is stored twice, in {plan[name][0].name} and {f.name}")
                meta = sf.get_slice(name)
                shape, stored = tuple(meta.get_shape()), _STORED.get(meta.get_dtype())
                if shape != expected[name]:
                    raise CheckpointError(f"{f.name}: tensor {name!r} has shape {shape}, expected {expected[name]}")
                if stored is None:
                    raise CheckpointError(
                        f"{f.name}: tensor {name!r} is stored as {meta.get_dtype()}, not a float type"
                    )
                plan[name] = (f, stored, math.prod(shape) * stored.itemsize)
    return plan


@contextlib.contextmanager
def _opened(f: Path) -> Iterator[Any]:
    """A weight file's header, or an error naming the file (shared/weight_files.py)."""
    try:
        sf = safe_open(str(f), framework="pt", device="cpu")
    except SafetensorError as exc:
        raise CheckpointError(unreadable(f.name, exc)) from None
    with sf:
        yield sf


def _progress(total: int, what: str) -> tqdm:
    """A byte progress bar on stderr, shown on a terminal only (a log file gets the timing line)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=what, unit="B", unit_scale=True, disable=None, leave=False)


def random_model(
    cfg: ModelConfig, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> SteerlingModel:
    """Random weights with peaked token and concept logits, so that greedy decoding and top-k
    concepts are decided by clear margins rather than float rounding. Filled tensor by tensor in
    the target dtype: an 8b model never exists in float32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        model = SteerlingModel(cfg).to(dtype)
    model = model.to_empty(device=device)
    if cfg.weight_sharing:
        model.transformer.tok_emb.weight = model.transformer.lm_head.weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, device=device)
            if name.endswith("norm.weight") or ".ln_" in name or name.endswith("ln_f.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name in (TIED, EMBEDDING) or "predictor" in name:
                p.copy_(noise * (3.0 / p.shape[-1] ** 0.5))
            else:
                p.copy_(noise * 0.02)
    return model.eval()


def save_checkpoint(model: SteerlingModel, cfg: ModelConfig, out: str | Path, max_shard_bytes: int = 4 << 30) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.safetensors"), out / INDEX]:  # a checkpoint written before: its index would win
        old.unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_published_dict(), indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (cfg.weight_sharing and k == TIED)}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def make_model(
    preset_name: str,
    out: str | Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    instruct: bool = False,
    max_shard_bytes: int = 4 << 30,
    device: str = "cpu",
    overrides: dict | None = None,
) -> Path:
    """`overrides`: config values replacing the preset's (e.g. a longer context, fewer layers)."""
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    cfg = preset(preset_name, instruct=instruct)
    if overrides:
        cfg = ModelConfig.from_dict({**dataclasses.asdict(cfg), **overrides})
    model = random_model(cfg, seed, DTYPES[dtype], device)
    save_checkpoint(model, cfg, out, max_shard_bytes)
    return Path(out)
