"""worker/checkpoint.py: the published on-disk layout, strict loading with clear errors, sharding,
tied weights, the official package reading our checkpoints, and the exact Steerling-8B shapes."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from cde.shared.config import ConfigError, preset
from cde.worker.checkpoint import (
    TIED,
    CheckpointError,
    load_checkpoint,
    make_model,
    random_model,
    save_checkpoint,
)
from cde.worker.model import SteerlingModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

EMB = "transformer.tok_emb.weight"


def published_names(n_layers: int) -> set[str]:
    names = {
        EMB,
        "transformer.ln_f.weight",
        "known_head.concept_predictor.weight",
        "known_head.concept_embedding.weight",
        "unknown_head.predictor_down.weight",
        "unknown_head.predictor_up.weight",
        "unknown_head.embedding_coef.weight",
        "unknown_head.embedding_basis.weight",
    }
    for i in range(n_layers):
        b = f"transformer.blocks.{i}"
        names |= {
            f"{b}.ln_1.weight",
            f"{b}.ln_2.weight",
            f"{b}.mlp.c_fc.weight",
            f"{b}.mlp.c_proj.weight",
            *(f"{b}.attn.{m}.weight" for m in ("c_attn", "c_proj", "q_norm", "k_norm")),
        }
    return names


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("ck") / "tiny", seed=7)


def tensors_of(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def rewrite(src, dst, state=None, config=None):
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config if config is not None else cfg))
    save_file(state if state is not None else tensors_of(src), str(dst / "model.safetensors"))
    return dst


def assert_same_weights(model, state):
    got = model.state_dict()
    for name, t in state.items():
        assert torch.equal(got[name], t), name


# ---- layout -------------------------------------------------------------------------------------
def test_make_model_writes_published_layout(tiny):
    cfg = preset("tiny")
    raw = json.loads((tiny / "config.json").read_text())
    assert raw == json.loads(json.dumps(cfg.to_published_dict()))
    assert "concept" not in raw and raw["n_concepts"] == 96 and raw["n_unknown_concepts"] == 256
    assert raw["mask_token_id"] == 100280 and raw["interpretable"] is True
    assert sorted(p.name for p in tiny.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in names}
    assert names == published_names(cfg.n_layers)  # tied lm_head not written
    assert shapes[EMB] == (100281, 64) and shapes["unknown_head.predictor_up.weight"] == (256, 16)
    assert shapes["transformer.blocks.1.attn.c_attn.weight"] == (64 + 2 * 2 * 16, 64)
    assert shapes["transformer.blocks.0.mlp.c_fc.weight"] == (2 * 256, 64)


def test_load_round_trip(tiny):
    cfg, model = load_checkpoint(tiny)
    assert cfg == preset("tiny") and not model.training
    expected = random_model(cfg, seed=7)
    assert_same_weights(model, expected.state_dict())
    # tied: one tensor for embedding and output head
    assert model.transformer.tok_emb.weight is model.transformer.lm_head.weight


def test_loading_imports_no_torchdynamo(tiny):
    """The worker builds the model on the meta device before it reads the weights: nothing there
    may run nn.Embedding's init, whose meta normal_ imports TorchDynamo (~2 s of every start).
    A fresh interpreter, as a worker is: this one may have imported it already."""
    code = (
        "import sys; from cde.worker.checkpoint import load_checkpoint; load_checkpoint(sys.argv[1]); "
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    )
    res = subprocess.run([sys.executable, "-c", code, str(tiny)], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


def test_a_model_built_off_the_meta_device_has_its_embeddings_initialized():
    """Off the meta device the embeddings get nn.Embedding's own init, N(0, 1), not empty memory."""
    model = SteerlingModel(preset("tiny"))
    for emb in (model.known_head.concept_embedding, model.unknown_head.embedding_coef):
        assert torch.isfinite(emb.weight).all() and emb.weight.std().item() == pytest.approx(1.0, abs=0.05)


def test_load_dtype_and_no_float32_copy_of_bf16(tmp_path):
    path = make_model("tiny", tmp_path / "bf", seed=1, dtype="bfloat16")

    class Watch(TorchDispatchMode):
        big_fp32 = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (
                isinstance(out, torch.Tensor)
                and out.device.type != "meta"
                and out.dtype == torch.float32
                and out.numel() >= 100281 * 64
            ):
                Watch.big_fp32 += 1
            return out

    with Watch():
        _cfg, model = load_checkpoint(path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert Watch.big_fp32 == 0, "a float32 copy of the embedding was allocated while loading bf16"
    _, m32 = load_checkpoint(path, dtype=torch.float32)
    assert m32.transformer.lm_head.weight.dtype == torch.float32
    assert torch.equal(m32.transformer.lm_head.weight.bfloat16(), model.transformer.lm_head.weight)


def test_nested_concept_config_loads(tiny, tmp_path):
    raw = json.loads((tiny / "config.json").read_text())
    concept_keys = [
        "n_concepts",
        "n_unknown_concepts",
        "factorize_rank",
        "topk_known",
        "topk_known_features",
        "unknown_topk",
        "pad_multiple",
        "concept_dim",
    ]
    nested = {k: raw.pop(k) for k in concept_keys}
    nested["block_size"] = raw.pop("concept_block_size")
    raw["concept"] = nested
    dst = tmp_path / "nested"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(raw))
    shutil.copy(tiny / "model.safetensors", dst / "model.safetensors")
    cfg, model = load_checkpoint(dst)
    assert cfg == preset("tiny")
    assert_same_weights(model, tensors_of(tiny))


def test_sharded_checkpoint_loads_identically(tiny, tmp_path):
    cfg, model = load_checkpoint(tiny)
    save_checkpoint(model, cfg, tmp_path / "sharded", max_shard_bytes=1 << 16)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == published_names(cfg.n_layers)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors_of(tiny).values())
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    cfg2, model2 = load_checkpoint(tmp_path / "sharded")
    assert cfg2 == cfg
    assert_same_weights(model2, model.state_dict())
    # a shard named by the index but missing on disk
    (tmp_path / "sharded" / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=shards[1]):
        load_checkpoint(tmp_path / "sharded")


def test_the_index_decides_which_files_are_read(tiny, tmp_path):
    """A sharded checkpoint's files are the shards its index names: a stray unreadable file beside
    them is not read (by the loader, nor by the CLI's check before a worker starts); a tensor
    stored in two of them, or a shard outside the directory, is refused by name."""
    from cde.shared.weight_files import check_headers

    from tests.hub_cache import cache_repo

    cfg, model = load_checkpoint(tiny)
    out = tmp_path / "sharded"
    save_checkpoint(model, cfg, out, max_shard_bytes=1 << 16)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    # a Hub snapshot: every file a link into the cache's blobs, outside the snapshot's directory
    snapshot = cache_repo(tmp_path / "hf", "acme/sharded", out, "0" * 40)
    check_headers(snapshot)
    assert_same_weights(load_checkpoint(snapshot)[1], model.state_dict())
    (out / "old-consolidated.safetensors").write_bytes(b"<!DOCTYPE html>")
    check_headers(out)
    assert_same_weights(load_checkpoint(out)[1], model.state_dict())

    first, second = sorted(set(index["weight_map"].values()))[:2]
    in_second = load_file(str(out / second))
    save_file({**in_second, EMB: torch.zeros_like(model.state_dict()[EMB])}, str(out / second))
    with pytest.raises(CheckpointError, match=f"'{EMB}' is stored twice, in {first} and {second}"):
        load_checkpoint(out)
    save_file(in_second, str(out / second))

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(out / first, elsewhere / first)
    moved = {name: (f"../elsewhere/{first}" if f == first else f) for name, f in index["weight_map"].items()}
    index_path.write_text(json.dumps({**index, "weight_map": moved}))
    for check in (load_checkpoint, check_headers):
        with pytest.raises(ValueError, match=f"outside the model directory: .*elsewhere/{first}"):
            check(out)


def test_untied_lm_head_only_loads(tiny, tmp_path):
    """lm_head present and tok_emb absent is the same tied tensor under its other name."""
    state = tensors_of(tiny)
    state[TIED] = state.pop(EMB)
    _, model = load_checkpoint(rewrite(tiny, tmp_path / "lm", state))
    assert torch.equal(model.transformer.tok_emb.weight, state[TIED])


def test_tied_pair_on_disk_takes_the_lm_head_as_the_official_loader(tiny, tmp_path):
    """Both names of the tied tensor on disk and different: the official loader ties the embedding
    to the LM head, so the LM head's values fill both, in one file and across shards."""
    from tests.oracle import official_model

    state = tensors_of(tiny)
    state[TIED] = state[EMB] + 1.0
    one = rewrite(tiny, tmp_path / "pair", state)
    ref, _ = official_model(one)
    cfg, model = load_checkpoint(one)
    assert torch.equal(model.transformer.lm_head.weight, ref.transformer.lm_head.weight)
    assert model.transformer.tok_emb.weight is model.transformer.lm_head.weight
    save_checkpoint(model, cfg, tmp_path / "sharded", max_shard_bytes=1 << 16)  # writes tok_emb only
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    extra = tmp_path / "sharded" / "model-00000-lm-head.safetensors"
    save_file({TIED: state[TIED] + 1.0}, str(extra))
    index["weight_map"][TIED] = extra.name  # the pair in two shards, the LM head's loaded first
    assert extra.name < index["weight_map"][EMB]
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    _, sharded = load_checkpoint(tmp_path / "sharded")
    assert torch.equal(sharded.transformer.tok_emb.weight, state[TIED] + 1.0)


def test_float64_weights_load_as_float32_like_the_official_loader(tiny, tmp_path):
    from tests.oracle import official_model

    state = {k: v.double() for k, v in tensors_of(tiny).items()}
    path = rewrite(tiny, tmp_path / "f64", state)
    ref, _ = official_model(path)
    _, model = load_checkpoint(path)
    got = model.state_dict()
    assert all(t.dtype == torch.float32 for t in got.values())
    for name, t in ref.state_dict().items():
        assert torch.equal(got[name], t), name


def test_malformed_index_names_the_file(tiny, tmp_path):
    for n, text in enumerate(["{}", "{not json", '{"weight_map": ["a"]}']):
        dst = rewrite(tiny, tmp_path / f"ix{n}")
        (dst / "model.safetensors.index.json").write_text(text)
        with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: not a safetensors index"):
            load_checkpoint(dst)


def test_a_checkpoint_written_over_another_leaves_none_of_its_files(tiny, tmp_path):
    """A sharded checkpoint overwritten by a single-file one: the stale index would win and load
    the old shards."""
    out = tmp_path / "over"
    make_model("tiny", out, seed=1, max_shard_bytes=1 << 20)
    assert (out / "model.safetensors.index.json").is_file()
    make_model("tiny", out, seed=7)  # the `tiny` fixture's weights
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "model.safetensors"]
    _, got = load_checkpoint(out)
    _, ref = load_checkpoint(tiny)
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), ref.state_dict().values(), strict=True))


# ---- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content", [b"", b"<!DOCTYPE html><html>404</html>", "cut"], ids=["empty", "html", "cut-short"]
)
def test_a_broken_weight_file_is_named(tiny, tmp_path, content):
    dst = tmp_path / "broken"
    dst.mkdir()
    shutil.copy(tiny / "config.json", dst / "config.json")
    whole = (tiny / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(whole[: len(whole) // 2] if content == "cut" else content)
    with pytest.raises(CheckpointError, match=r"^model\.safetensors is not a readable safetensors file \("):
        load_checkpoint(dst)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_missing_config(tiny, tmp_path):
    dst = tmp_path / "noconf"
    dst.mkdir()
    shutil.copy(tiny / "model.safetensors", dst / "model.safetensors")
    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_checkpoint(dst)


def test_no_weights(tiny, tmp_path):
    dst = tmp_path / "noweights"
    dst.mkdir()
    shutil.copy(tiny / "config.json", dst / "config.json")
    with pytest.raises(CheckpointError, match=r"no \*.safetensors"):
        load_checkpoint(dst)


def test_missing_tensor(tiny, tmp_path):
    state = tensors_of(tiny)
    del state["transformer.blocks.1.mlp.c_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): \['transformer.blocks.1.mlp.c_proj.weight'\]"):
        load_checkpoint(rewrite(tiny, tmp_path / "m", state))


def test_missing_both_tied_names(tiny, tmp_path):
    state = tensors_of(tiny)
    del state[EMB]
    with pytest.raises(CheckpointError, match=r"transformer\.tok_emb\.weight"):
        load_checkpoint(rewrite(tiny, tmp_path / "m", state))


def test_untied_checkpoint_needs_lm_head(tiny, tmp_path):
    raw = {**json.loads((tiny / "config.json").read_text()), "weight_sharing": False}
    with pytest.raises(CheckpointError, match=r"transformer\.lm_head\.weight"):
        load_checkpoint(rewrite(tiny, tmp_path / "u", config=raw))


def test_extra_tensor(tiny, tmp_path):
    state = {**tensors_of(tiny), "transformer.blocks.2.ln_1.weight": torch.ones(64)}
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'transformer\.blocks\.2\.ln_1\.weight'"):
        load_checkpoint(rewrite(tiny, tmp_path / "x", state))


def test_misshaped_tensor(tiny, tmp_path):
    state = tensors_of(tiny)
    state["unknown_head.predictor_down.weight"] = torch.zeros(8, 64)
    with pytest.raises(
        CheckpointError, match=r"'unknown_head.predictor_down.weight' has shape \(8, 64\), expected \(16, 64\)"
    ):
        load_checkpoint(rewrite(tiny, tmp_path / "s", state))


def test_integer_tensor(tiny, tmp_path):
    state = tensors_of(tiny)
    state["transformer.ln_f.weight"] = torch.ones(64, dtype=torch.int32)
    with pytest.raises(CheckpointError, match=r"'transformer\.ln_f\.weight' is stored as I32, not a float type"):
        load_checkpoint(rewrite(tiny, tmp_path / "i", state))


def test_load_reports_its_time_and_size(tiny, caplog):
    caplog.set_level("INFO", logger="cde.checkpoint")
    load_checkpoint(tiny)
    [record] = [r for r in caplog.records if r.getMessage().startswith("weights loaded in")]
    assert record.bytes == sum(t.numel() * t.element_size() for t in tensors_of(tiny).values())
    assert record.load_s > 0 and "to cpu" in record.getMessage()


@pytest.mark.parametrize(
    "key,value",
    [("mlp_type", "standard"), ("norm_order", "sandwich"), ("use_rope", False), ("factorize_unknown", False)],
)
def test_unsupported_architecture(tiny, tmp_path, key, value):
    raw = {**json.loads((tiny / "config.json").read_text()), key: value}
    dst = tmp_path / "arch"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=f"unsupported architecture value {key}={value!r}"):
        load_checkpoint(dst)


def test_make_model_rejects_bad_dtype_and_preset(tmp_path):
    with pytest.raises(ConfigError, match="unknown dtype 'int8'"):
        make_model("tiny", tmp_path / "a", dtype="int8")
    with pytest.raises(ConfigError, match="unknown preset"):
        make_model("nano", tmp_path / "b")


# ---- the official package -----------------------------------------------------------------------
def test_official_package_loads_our_checkpoint(tiny):
    from tests.oracle import official_model

    model, _raw = official_model(tiny)  # asserts: no unexpected keys, only lm_head missing
    ours = tensors_of(tiny)
    theirs = model.state_dict()
    assert set(theirs) == set(ours) | {TIED}
    for name, t in ours.items():
        assert torch.equal(theirs[name], t), name
    assert torch.equal(theirs[TIED], ours[EMB])


def test_we_load_official_classes_checkpoint(tiny_official_dir):
    cfg, model = load_checkpoint(tiny_official_dir)
    assert cfg == preset("tiny")
    assert_same_weights(model, tensors_of(tiny_official_dir))


def test_8b_preset_shapes_match_steerling_8b():
    from steerling.models.interpretable.interpretable_causal_diffusion import InterpretableCausalDiffusionLM

    from tests.oracle import official_configs

    cfg = preset("8b")
    with torch.device("meta"):
        ours = SteerlingModel(cfg)
        mc, cc = official_configs(cfg.to_published_dict())
        ref = InterpretableCausalDiffusionLM(mc, cc, cfg.vocab_size)
    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert len([k for k in shapes if k.endswith("mlp.c_fc.weight")]) == 32
    assert shapes[EMB] == shapes[TIED] == (100281, 4096)
    assert shapes["transformer.blocks.31.attn.c_attn.weight"] == (4096 + 2 * 4 * 128, 4096)
    assert shapes["transformer.blocks.0.attn.q_norm.weight"] == (128,)
    assert shapes["transformer.blocks.0.mlp.c_fc.weight"] == (2 * 16384, 4096)
    assert shapes["transformer.blocks.0.mlp.c_proj.weight"] == (4096, 16384)
    assert (
        shapes["known_head.concept_predictor.weight"] == shapes["known_head.concept_embedding.weight"] == (33744, 4096)
    )
    assert shapes["unknown_head.predictor_down.weight"] == (256, 4096)
    assert shapes["unknown_head.predictor_up.weight"] == shapes["unknown_head.embedding_coef.weight"] == (101200, 256)
    assert shapes["unknown_head.embedding_basis.weight"] == (4096, 256)
    n_params = sum(p.numel() for p in ours.parameters())  # tied weights counted once
    assert 8.3e9 < n_params < 8.5e9
    assert n_params == sum(p.numel() for p in ref.parameters())
    assert ours.transformer.tok_emb.weight is ours.transformer.lm_head.weight
