"""The official `steerling` package as the test oracle.

`.ci/run` installs steerling==0.2.0 (declared for Python >= 3.13, its code runs on 3.11; installed
with --no-deps --ignore-requires-python). This module builds the official model and generator
from a checkpoint directory in the published layout, and writes checkpoints *with* the official
model classes, so tests compare CDE against the real reference implementation.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

_CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


def offline_tiktoken_cache() -> None:
    """The reference tokenizer asks tiktoken for `cl100k_base`; serve it the bundled ranks from
    tiktoken's own cache so nothing downloads."""
    import tiktoken_ext

    src = Path(tiktoken_ext.__path__[0]) / "data" / "cl100k_base.tiktoken"
    cache = Path(os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(Path.home() / ".cache" / "cde-tiktoken")))
    cache.mkdir(parents=True, exist_ok=True)
    dst = cache / hashlib.sha1(_CL100K_URL.encode()).hexdigest()
    if not dst.exists():
        shutil.copy(src, dst)


def official_configs(raw: dict):
    from steerling.configs.causal_diffusion import CausalDiffusionConfig
    from steerling.configs.concept import ConceptConfig

    model_cfg = CausalDiffusionConfig.model_validate(
        {k: v for k, v in raw.items() if k in CausalDiffusionConfig.model_fields}
    )
    concept_cfg = ConceptConfig(
        n_concepts=raw["n_concepts"],
        n_unknown_concepts=raw["n_unknown_concepts"],
        concept_dim=raw["n_embd"],
        topk_known=raw["topk_known"],
        topk_known_features=raw["topk_known_features"],
        unknown_topk=raw["unknown_topk"],
        factorize_rank=raw["factorize_rank"],
        block_size=raw["concept_block_size"],
        pad_multiple=raw["pad_multiple"],
    )
    return model_cfg, concept_cfg


def official_model(model_dir: str | Path, device: str = "cpu", dtype=None):
    """InterpretableCausalDiffusionLM loaded strictly from a checkpoint in the published layout
    (float32, or `dtype`), built directly on `device` (an 8B model initialises in seconds on a
    GPU). `model_dir` is a directory or a Hub id: the official loader reads either (from the
    Hub cache) and strips the Hub's bookkeeping keys from config.json."""
    from steerling.inference.checkpoint_utils import load_config, load_state_dict
    from steerling.models.interpretable.interpretable_causal_diffusion import InterpretableCausalDiffusionLM

    raw = load_config(str(model_dir))
    model_cfg, concept_cfg = official_configs(raw)
    with torch.device(device):
        model = InterpretableCausalDiffusionLM(model_cfg, concept_cfg, raw["vocab_size"])
    missing, unexpected = model.load_state_dict(load_state_dict(str(model_dir)), strict=False)
    assert not unexpected, unexpected
    assert all("lm_head" in k for k in missing), missing
    model.transformer._restore_weight_tying()
    return model.to(dtype or torch.float32).eval(), raw


def official_generator(model_dir: str | Path):
    offline_tiktoken_cache()
    from steerling.data.tokenizer import SteerlingTokenizer
    from steerling.inference.causal_diffusion import SteerlingGenerator

    model, raw = official_model(model_dir)
    model_cfg, _ = official_configs(raw)
    tok = SteerlingTokenizer(instruct=raw.get("instruct", False))
    return SteerlingGenerator(model, tok, model_cfg, is_interpretable=True, device="cpu")


def write_with_official_classes(cde_preset, out: str | Path, seed: int, ln_f_scale: float = 1.0) -> Path:
    """A checkpoint whose tensors come from the official model classes' own state_dict.
    `ln_f_scale` multiplies the final norm's weight: the token logits' spread with it (the LM head
    is tied), until float32 softmax saturates at 1.0 and confidences tie."""
    from steerling.models.interpretable.interpretable_causal_diffusion import InterpretableCausalDiffusionLM

    raw = cde_preset.to_published_dict()
    model_cfg, concept_cfg = official_configs(raw)
    torch.manual_seed(seed)
    model = InterpretableCausalDiffusionLM(model_cfg, concept_cfg, raw["vocab_size"])
    with torch.no_grad():
        # The official init (std 0.02) leaves token logits almost flat; sharpen the output
        # embedding and the concept predictors so decisions are not made by float rounding.
        for name, p in model.named_parameters():
            if name == "transformer.lm_head.weight" or "predictor" in name:
                p.mul_(150.0 / p.shape[-1] ** 0.5)
            if name == "transformer.ln_f.weight":
                p.mul_(ln_f_scale)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "transformer.lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def greedy_config(n_new: int, per_step: int = 1):
    """The official generator's config for greedy decoding, `per_step` tokens a step (its linear
    schedule), no entropy sampling, top-p or repetition penalty: what the parity tests compare."""
    from steerling.configs.generation import GenerationConfig

    return GenerationConfig(
        max_new_tokens=n_new,
        steps=n_new // per_step,
        temperature=0,
        use_entropy_sampling=False,
        top_p=0,
        repetition_penalty=1,
    )
