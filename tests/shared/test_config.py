"""shared/config.py: presets, flat and nested config.json parsing, rejection of what CDE cannot serve."""

import dataclasses
import json

import pytest
from cde.shared.config import (
    EOT_ID,
    INSTRUCT_VOCAB,
    PAGE,
    PRESETS,
    ConfigError,
    ModelConfig,
    preset,
)

from tests.published import published, published_instruct


def test_published_8b_config_loads_as_is():
    raw = published()
    assert raw["model_type"] == "steerling" and raw["architectures"] == ["SteerlingForCausalLM"]
    c = ModelConfig.from_dict(raw)
    # The 8b shape, except that the published head reports 16 known concepts out of the 32 it
    # composes features from (the official ConceptHead's topk / topk_features).
    assert c == dataclasses.replace(preset("8b"), topk_known=16)
    assert (c.topk_known, c.known_topk_features) == (16, 32)


def test_published_instruct_config_loads_as_is():
    c = ModelConfig.from_dict(published_instruct())
    assert c == dataclasses.replace(preset("8b", instruct=True), topk_known=16)
    assert c.eot_id == EOT_ID


def test_8b_preset_is_steerling_8b():
    c = preset("8b")
    assert (c.n_layers, c.n_embd, c.n_head, c.n_kv_heads, c.head_dim) == (32, 4096, 32, 4, 128)
    assert (c.vocab_size, c.n_concepts, c.n_unknown_concepts, c.factorize_rank) == (100281, 33732, 101196, 256)
    assert c.ffn_size == 16384
    assert (c.context_len, c.diff_block_size, c.max_blocks) == (4096, 64, 64)
    assert (c.known_padded, c.unknown_padded) == (33744, 101200)
    assert c.norm_order == "post" and c.use_qk_norm and c.weight_sharing and c.clip_qkv == 10.0
    assert c.rope_base == 500000.0 and not c.instruct and c.eot_id is None


def test_instruct_preset_and_unknown_preset():
    for name in PRESETS:
        c = preset(name, instruct=True)
        assert c.instruct and c.vocab_size == INSTRUCT_VOCAB and c.eot_id == EOT_ID
        assert dataclasses.replace(c, instruct=False, vocab_size=100281) == PRESETS[name]
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_published_dict_round_trips(name):
    for instruct in (False, True):
        c = preset(name, instruct=instruct)
        d = c.to_published_dict()
        # the published layout is flat, with the architecture switches and the token ids
        assert "concept" not in d and d["mlp_type"] == "swiglu" and d["mask_token_id"] == 100280
        assert d["model_type"] == "causal_diffusion" and d["concept_dim"] == c.n_embd
        assert ModelConfig.from_dict(json.loads(json.dumps(d))) == c


def test_nested_concept_block_from_official_classes():
    from steerling.configs.causal_diffusion import CausalDiffusionConfig
    from steerling.configs.concept import ConceptConfig

    model = CausalDiffusionConfig(
        n_layers=3, n_head=4, n_kv_heads=2, n_embd=64, block_size=512, interpretable=True
    ).model_dump()
    concept = ConceptConfig(
        n_concepts=100,
        n_unknown_concepts=300,
        concept_dim=64,
        topk_known=8,
        topk_known_features=4,
        unknown_topk=16,
        factorize_rank=16,
        block_size=256,
        pad_multiple=32,
    ).model_dump()
    raw = {**model, "vocab_size": 100281, "concept": concept}
    c = ModelConfig.from_dict(raw)
    assert (c.n_layers, c.n_head, c.n_kv_heads, c.n_embd, c.context_len) == (3, 4, 2, 64, 512)
    assert (c.n_concepts, c.n_unknown_concepts, c.factorize_rank) == (100, 300, 16)
    assert (c.topk_known, c.known_topk_features, c.unknown_topk) == (8, 4, 16)
    # the nested block_size is the concept head's, not the context length
    assert c.concept_block_size == 256 and c.context_len == 512
    assert (c.known_padded, c.unknown_padded) == (128, 320)


def test_the_nested_block_alone_describes_the_heads():
    """As the official loader (`SteerlingGenerator.from_pretrained` builds the heads from
    `ConceptConfig.model_validate(config["concept"])`): flat concept keys beside the block are
    stale, and what the block leaves out takes ConceptConfig's defaults, not the flat value."""
    from steerling.configs.concept import ConceptConfig

    nested = {"n_concepts": 5, "n_unknown_concepts": 40, "factorize_rank": 16, "topk_known": 2, "unknown_topk": 8}
    raw = {**preset("tiny").to_published_dict(), "concept": nested}  # flat: 96 concepts, pad 16, ...
    c = ModelConfig.from_dict(raw)
    official = ConceptConfig.model_validate(nested)
    for field in ("n_concepts", "n_unknown_concepts", "factorize_rank", "topk_known", "unknown_topk", "pad_multiple"):
        assert getattr(c, field) == getattr(official, field), field
    assert c.known_topk_features == (official.topk_known_features or official.topk_known)


def test_concept_fields_are_the_official_concept_config():
    from cde.shared import config
    from steerling.configs.concept import ConceptConfig

    assert set(config._CONCEPT_FIELDS) == {config._NESTED_ALIASES.get(k, k) for k in ConceptConfig.model_fields}


def test_instruct_flag_defaults_vocab():
    raw = preset("tiny").to_published_dict()
    del raw["vocab_size"]
    assert ModelConfig.from_dict(raw).vocab_size == 100281
    raw["instruct"] = True
    c = ModelConfig.from_dict(raw)
    assert c.vocab_size == INSTRUCT_VOCAB and c.eot_id == EOT_ID


@pytest.mark.parametrize(
    "key,value",
    [
        ("mlp_type", "standard"),
        ("use_rope", False),
        ("use_rms_norm", False),
        ("use_bias", True),
        ("model_type", "llama"),
        ("factorize_unknown", False),
        ("topk_on_logits", True),
        ("use_attention_known", True),
        ("use_unknown", False),
        ("norm_order", "sandwich"),
        ("diff_block_size", 32),
        # the official package builds each of these, with other math than CDE's
        ("use_epsilon_correction", False),
        ("rope_full_precision", False),
        ("interpretable", False),
    ],
)
@pytest.mark.parametrize("layout", ["cde", "published"])
def test_unsupported_architecture_values(key, value, layout):
    base = preset("tiny").to_published_dict() if layout == "cde" else published()
    with pytest.raises(ConfigError, match=f"unsupported architecture value {key}="):
        ModelConfig.from_dict({**base, key: value})


def test_unsupported_value_in_nested_block():
    raw = {**preset("tiny").to_published_dict(), "concept": {"use_attention_unknown": True}}
    raw.pop("use_attention_unknown")
    with pytest.raises(ConfigError, match="use_attention_unknown"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize(
    "change,msg",
    [
        ({"n_head": 5}, "divisible by n_head"),
        ({"n_kv_heads": 3}, "divisible by n_kv_heads"),
        ({"n_kv_heads": 0}, "n_kv_heads"),
        ({"vocab_size": 50000}, "too small"),
        ({"instruct": True, "vocab_size": 100281}, "instruct model needs vocab_size"),
        ({"unknown_topk": None}, r"unknown_topk must be a positive integer, got None \(null: no top-k"),
        ({"topk_known": None}, r"topk_known must be a positive integer, got None \(null: no top-k"),
        ({"n_unknown_concepts": None}, "n_unknown_concepts must be a positive integer"),
        ({"factorize_rank": 0}, "factorize_rank must be a positive integer"),
        ({"topk_known_features": 0}, "topk_known_features must be positive or null"),
        # each refused here, by name, rather than as a TypeError, a ZeroDivisionError or NaN
        # output once a model runs with it (an audit, 2026-12-06)
        ({"norm_eps": "x"}, "norm_eps must be a positive number, got 'x'"),
        ({"norm_eps": float("nan")}, "norm_eps must be a positive number, got nan"),
        ({"rope_base": "x"}, "rope_base must be a positive number"),
        ({"clip_qkv": 0}, "clip_qkv must be a positive number"),
        ({"mlp_ratio": 0}, "mlp_ratio must be a positive number"),
        ({"block_size": "big"}, "block_size must be a positive integer, got 'big'"),
        ({"pad_multiple": 0}, "pad_multiple must be a positive integer"),
        ({"intermediate_size": "x"}, "intermediate_size must be a positive integer"),
        ({"concept_block_size": True}, "concept_block_size must be a positive integer"),
        # a string where JSON has true/false would read as true (weight_sharing "false" tied the
        # embedding to the LM head: an audit, 2026-12-06)
        ({"weight_sharing": "false"}, "weight_sharing must be true or false, got 'false'"),
        ({"use_qk_norm": "false"}, "use_qk_norm must be true or false"),
        ({"instruct": 1}, "instruct must be true or false, got 1"),
    ],
)
def test_invalid_configs(change, msg):
    raw = {**preset("tiny").to_published_dict(), **change}
    with pytest.raises(ConfigError, match=msg):
        ModelConfig.from_dict(raw)


def test_keys_nobody_reads_are_ignored_with_a_warning(caplog):
    """A config re-saved by transformers carries keys of its own; the official loader keeps only
    its fields, so these change nothing there either: CDE loads the same config and names them."""
    raw = {**published(), "tie_word_embeddings": True, "_name_or_path": "x", "use_cache": True}
    with caplog.at_level("WARNING", logger="cde.config"):
        assert ModelConfig.from_dict(raw) == ModelConfig.from_dict(published())
        ModelConfig.from_dict(raw)  # read again in the same process (`cde generate` does): said once
    assert caplog.text.count("['_name_or_path', 'tie_word_embeddings', 'use_cache']") == 1, caplog.text


@pytest.mark.reference
def test_every_field_of_the_official_configs_is_read_fixed_or_ignored_for_a_reason():
    """Ignoring unknown keys is safe only if CDE knows every key the official package reads: each
    field of its model and concept configs is a field of CDE's, a value CDE checks, or one of the
    keys listed as not changing the math."""
    from cde.shared import config
    from steerling.configs.causal_diffusion import CausalDiffusionConfig
    from steerling.configs.concept import ConceptConfig

    official = set(CausalDiffusionConfig.model_fields) | {
        config._NESTED_ALIASES.get(k, k) for k in ConceptConfig.model_fields
    }
    handled = {f.name for f in dataclasses.fields(ModelConfig)} | set(config._FIXED) | config._IGNORED
    assert official - handled == {config.PUBLISHED_CONTEXT_KEY}  # read as context_len


def test_null_kv_heads_means_multi_head():
    raw = {**preset("tiny").to_published_dict(), "n_kv_heads": None}
    assert ModelConfig.from_dict(raw).n_kv_heads == raw["n_head"]


def test_from_json_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"no config\.json"):
        ModelConfig.from_json(tmp_path / "config.json")
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        ModelConfig.from_json(p)
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        ModelConfig.from_json(p)
    p.write_text(json.dumps(preset("small").to_published_dict()))
    assert ModelConfig.from_json(p) == preset("small")


def test_config_error_is_value_error_and_page_is_64():
    assert issubclass(ConfigError, ValueError) and PAGE == 64


def test_context_length_is_read_and_written_under_the_published_key():
    c = preset("tiny")
    d = c.to_published_dict()
    assert d["block_size"] == c.context_len == 1024 and "context_len" not in d
    assert ModelConfig.from_dict(d) == c
    assert ModelConfig.from_dict({**d, "block_size": 2048}).context_len == 2048
