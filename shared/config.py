"""Model configuration: parse a Steerling `config.json` (flat as published, or with a nested
`concept` block) into one frozen dataclass, and the presets `cde make-model` writes.

No torch here: the gateway reads the config too (context length, vocabulary, instruct flag).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

PAGE = 64  # diffusion block = attention tile = KV page
log = logging.getLogger("cde.config")
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """One process may read a config.json twice (`cde generate`: the CLI's check, then the load)."""
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


# How a forward item attends (FlashBlock): over all its pages at once; split into the cached
# pages (recomputed, then kept) and its own block, merged by log-sum-exp; or the same split
# with the cached part reused from an earlier step.
ATTN_EXACT, ATTN_REFRESH, ATTN_REUSE = 0, 1, 2
# --quantization fp8: passes of at most this many rows run weight-only (cde.worker.fp8). Measured on
# the H200 (random 8b, 1 request, attribution on, 2026-12-02): weight-only 6.57 ms per pass (the
# Triton GEMM widening FP8 weight tiles to bfloat16 takes twice the FP8 GEMM's time), FP8 GEMMs
# 4.30 ms, bfloat16 5.81 ms. So FP8 GEMMs at every size.
FP8_WEIGHT_ONLY_ROWS = 0


# The published config.json's key for the context length (ModelConfig.context_len). Its nested
# `concept` block has a `block_size` too: the concept head's (ModelConfig.concept_block_size).
PUBLISHED_CONTEXT_KEY = "block_size"


class ConfigError(ValueError):
    """The checkpoint's config.json describes something CDE cannot serve."""


# Token ids of the Steerling tokenizer (cl100k_base + specials).
EOS_ID = 100257
PAD_ID = 100277
BOS_ID = 100278
ENDOFCHUNK_ID = 100279
MASK_ID = 100280
START_HEADER_ID = 100281
END_HEADER_ID = 100282
EOT_ID = 100283
BASE_VOCAB = 100281
INSTRUCT_VOCAB = 100284


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_number(value: object) -> bool:
    """A finite number above 0 (JSON's NaN and Infinity are not numbers a model can run with)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int = 32
    n_head: int = 32
    n_kv_heads: int = 4
    n_embd: int = 4096
    # Context length (positions). The published config.json calls it `block_size`; CDE reads and
    # writes that key, but keeps "block" for the 64-token diffusion block.
    context_len: int = 4096
    diff_block_size: int = PAGE
    vocab_size: int = BASE_VOCAB
    intermediate_size: int | None = None  # default mlp_ratio * n_embd
    mlp_ratio: int = 4
    norm_eps: float = 1e-5
    norm_order: str = "post"
    use_qk_norm: bool = True
    rope_base: float = 500000.0
    clip_qkv: float | None = 10.0
    weight_sharing: bool = True
    instruct: bool = False
    # concept heads
    n_concepts: int = 33732
    n_unknown_concepts: int = 101196
    factorize_rank: int = 256
    topk_known: int = 32
    topk_known_features: int | None = 32
    unknown_topk: int = 128
    concept_block_size: int = 4096
    pad_multiple: int = 16

    # ---- derived -------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or self.mlp_ratio * self.n_embd

    @property
    def known_padded(self) -> int:
        return _round_up(self.n_concepts, self.pad_multiple)

    @property
    def unknown_padded(self) -> int:
        return _round_up(self.n_unknown_concepts, self.pad_multiple)

    @property
    def known_topk_features(self) -> int:
        return self.topk_known_features or self.topk_known

    @property
    def eot_id(self) -> int | None:
        return EOT_ID if self.instruct else None

    @property
    def token_vocab(self) -> int:
        """Ids the tokenizer can decode. A checkpoint may pad its embedding past them (100352 rows
        have been reported for the published instruct model); those rows are never sampled."""
        return min(self.vocab_size, INSTRUCT_VOCAB if self.instruct else BASE_VOCAB)

    @property
    def max_blocks(self) -> int:
        return -(-self.context_len // PAGE)

    # ---- (de)serialisation ---------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        data = {k: v for k, v in raw.items() if k not in _IGNORED}
        if PUBLISHED_CONTEXT_KEY in data:  # the published name wins (`--set block_size=...` over a preset)
            data["context_len"] = data.pop(PUBLISHED_CONTEXT_KEY)
        nested = data.pop("concept", None)
        if isinstance(nested, dict):
            # The official package's own layout: its loader builds the heads from this block
            # alone (absent keys take ConceptConfig's defaults), so flat copies beside it are stale.
            stale = sorted(k for k in _CONCEPT_FIELDS if data.pop(k, None) is not None)
            if stale:
                _warn_once(f"config.json: the nested concept block describes the heads; ignoring flat {stale}")
            for key, value in nested.items():
                mapped = _NESTED_ALIASES.get(key, key)
                if mapped not in _IGNORED:
                    data[mapped] = value
        for key, allowed in _FIXED.items():
            value = data.pop(key, next(iter(allowed)))
            if value not in allowed:
                raise ConfigError(
                    f"config.json: unsupported architecture value {key}={value!r}"
                    f" (CDE serves {key} in {sorted(map(str, allowed))})"
                )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:  # e.g. a re-saved config's `use_cache`: the official loader keeps only its own fields too
            _warn_once(f"config.json: ignoring keys that neither CDE nor the official package reads: {unknown}")
            data = {k: v for k, v in data.items() if k in names}
        if "n_kv_heads" in data and data["n_kv_heads"] is None:  # reference: None = one KV head per head
            data["n_kv_heads"] = data.get("n_head", cls.n_head)
        if data.get("instruct") and "vocab_size" not in data:
            data["vocab_size"] = INSTRUCT_VOCAB
        cfg = cls(**data)
        cfg.validate()
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: invalid JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(raw)

    def validate(self) -> None:
        for key in ("n_layers", "n_head", "n_kv_heads", "n_embd", "vocab_size", *_CONCEPT_COUNTS):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                # null top-k (every concept, no sparsity) is the official package's too; not built here
                unbuilt = " (null: no top-k, which CDE does not implement)" if value is None else ""
                raise ConfigError(f"config.json: {key} must be a positive integer, got {value!r}{unbuilt}")
        for key in ("context_len", "pad_multiple", "concept_block_size", "intermediate_size"):
            value = getattr(self, key)
            if not (key == "intermediate_size" and value is None) and not _positive_int(value):
                name = PUBLISHED_CONTEXT_KEY if key == "context_len" else key
                raise ConfigError(f"config.json: {name} must be a positive integer, got {value!r}")
        for key in ("norm_eps", "rope_base", "mlp_ratio", "clip_qkv"):
            value = getattr(self, key)
            if not (key == "clip_qkv" and value is None) and not _positive_number(value):
                raise ConfigError(f"config.json: {key} must be a positive number, got {value!r}")
        if self.topk_known_features is not None and not _positive_int(self.topk_known_features):
            raise ConfigError(
                f"config.json: topk_known_features must be positive or null, got {self.topk_known_features!r}"
            )
        for key in ("use_qk_norm", "weight_sharing", "instruct"):
            value = getattr(self, key)
            if not isinstance(value, bool):  # a string "false" would read as true
                raise ConfigError(f"config.json: {key} must be true or false, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_heads:
            raise ConfigError(f"n_head ({self.n_head}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.diff_block_size != PAGE:
            raise ConfigError(
                f"unsupported architecture value diff_block_size={self.diff_block_size} (CDE serves {PAGE})"
            )
        if self.norm_order not in ("pre", "post"):
            raise ConfigError(f"unsupported architecture value norm_order={self.norm_order!r}")
        if self.vocab_size <= MASK_ID:
            raise ConfigError(f"vocab_size {self.vocab_size} is too small for the Steerling special tokens")
        if self.instruct and self.vocab_size <= EOT_ID:
            raise ConfigError(f"instruct model needs vocab_size >= {INSTRUCT_VOCAB}, got {self.vocab_size}")

    def to_published_dict(self) -> dict:
        """The flat config.json layout of the published checkpoints."""
        d = {PUBLISHED_CONTEXT_KEY if k == "context_len" else k: v for k, v in dataclasses.asdict(self).items()}
        d.update(
            model_type="causal_diffusion",
            interpretable=True,
            use_epsilon_correction=True,
            use_rms_norm=True,
            use_rope=True,
            rope_full_precision=True,
            mlp_type="swiglu",
            use_bias=False,
            use_unknown=True,
            factorize_unknown=True,
            apply_topk_to_unknown=True,
            topk_on_logits=False,
            use_attention_known=False,
            use_attention_unknown=False,
            concept_dim=self.n_embd,
            pad_token_id=PAD_ID,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            mask_token_id=MASK_ID,
            endofchunk_token_id=ENDOFCHUNK_ID,
        )
        return d


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# Keys that describe the layout but that CDE does not need: Hub bookkeeping (the official loader
# strips the same four), token ids (fixed by the tokenizer; the instruct variant adds its chat
# header and end-of-turn ids), the checkpoint's storage dtype (the server picks one), training-time
# switches, and the default steering layer and alpha (CDE's steering presets set them per request).
_IGNORED = {
    "architectures",
    "auto_map",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "model_type_hf",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "mask_token_id",
    "endofchunk_token_id",
    "eot_token_id",
    "start_header_token_id",
    "end_header_token_id",
    "eot_id",
    "start_header_id",
    "end_header_id",
    "concept_dim",
    "max_concepts",
    "store_unknown_weights",
    "inject_layer",
    "inject_alpha",
}
# The concept heads' sizes and top-k widths: positive integers (the official package also takes
# null for the top-k widths and the unknown head's size; CDE serves the sparse heads only).
_CONCEPT_COUNTS = ("n_concepts", "n_unknown_concepts", "factorize_rank", "topk_known", "unknown_topk")
# Architecture switches whose other values CDE does not implement.
_FIXED: dict[str, set] = {
    # "steerling": the published Hub config (its Hugging Face file builder); "causal_diffusion":
    # the official package's own configs.
    "model_type": {"causal_diffusion", "steerling"},
    "use_rms_norm": {True},
    "use_rope": {True},
    "mlp_type": {"swiglu"},
    "use_bias": {False},
    "use_unknown": {True},
    "factorize_unknown": {True},
    "apply_topk_to_unknown": {True},
    "topk_on_logits": {False},
    "use_attention_known": {False},
    "use_attention_unknown": {False},
    "activation": {"gelu", "silu", "relu"},  # unused by SwiGLU
    # The official default is False (a plain CausalDiffusionLM, no concept heads); a config
    # without the key is served as interpretable, the one architecture CDE builds.
    "interpretable": {True},
    "use_epsilon_correction": {True},  # off, logits come from the bottleneck alone: not built
    "rope_full_precision": {True},  # off, RoPE in the model's dtype: not built
}
_NESTED_ALIASES = {"block_size": "concept_block_size"}
# The official ConceptConfig's fields under their flat names: what the nested block describes.
_CONCEPT_FIELDS = (
    *_CONCEPT_COUNTS,
    "max_concepts",
    "concept_dim",
    "use_attention_known",
    "use_attention_unknown",
    "topk_known_features",
    "use_unknown",
    "factorize_unknown",
    "use_epsilon_correction",
    "concept_block_size",
    "pad_multiple",
    "topk_on_logits",
    "store_unknown_weights",
    "apply_topk_to_unknown",
    "inject_layer",
    "inject_alpha",
)


PRESETS: dict[str, ModelConfig] = {
    # Exact Steerling-8B shape.
    "8b": ModelConfig(),
    # Small shapes for CPU: same vocabulary (the tokenizer fixes it), few layers, narrow.
    "small": ModelConfig(
        n_layers=4,
        n_head=8,
        n_kv_heads=2,
        n_embd=256,
        context_len=1024,
        n_concepts=512,
        n_unknown_concepts=2048,
        factorize_rank=32,
        topk_known=32,
        topk_known_features=32,
        unknown_topk=64,
        concept_block_size=512,
    ),
    "tiny": ModelConfig(
        n_layers=2,
        n_head=4,
        n_kv_heads=2,
        n_embd=64,
        context_len=1024,
        n_concepts=96,
        n_unknown_concepts=256,
        factorize_rank=16,
        topk_known=8,
        topk_known_features=8,
        unknown_topk=16,
        concept_block_size=128,
    ),
}


def preset(name: str, *, instruct: bool = False) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    cfg = PRESETS[name]
    if instruct:
        cfg = dataclasses.replace(cfg, instruct=True, vocab_size=INSTRUCT_VOCAB)
    return cfg
