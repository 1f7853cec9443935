"""worker/gemm_tuning.py on the CPU: `tune` over real split-K GEMM calls (kernels/stream_gemm.py in
Triton's interpreter, float16 as in tests/kernels/test_triton_interpreted.py) with a clock the test
gives (only a GPU has kernels to time): the fastest candidate that builds and agrees with the
reference is pinned, and the calls without a config run it from then on; the picks kept in a file
(worker/gemm_tuning_cache.py) are pinned untimed by the next process while they still hold."""

import json

import pytest
import torch
from cde.kernels import fp8_ops, stream_gemm, stream_gemm_configs
from cde.worker import fp8, gemm_tuning
from cde.worker.checkpoint import load_checkpoint
from cde.worker.gemm_tuning_cache import TuningCache

N, K = 96, 512


def clock(times: list[float]):
    """Runs each timed chain once and says the next of `times`; records the names it was given."""
    it = iter(times)
    seen = []

    def time_ms(name, calls):
        calls()
        seen.append(name)
        return next(it)

    return time_ms, seen


@pytest.fixture
def chain():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, K, generator=g).half()
    layers = [((torch.randn(N, K, generator=g) * 0.05).half(), stream_gemm.counter_count(N)) for _ in range(2)]
    layers = [(w, torch.zeros(c, dtype=torch.int32)) for w, c in layers]
    reference = [(a.double() @ w.double().t()).float() for w, _ in layers]

    def calls(config, pin=False):
        return [stream_gemm.stream_gemm(a, w, c, torch.float32, config=config, pin=pin) for w, c in layers]

    yield a, layers, reference, calls
    stream_gemm_configs.unpin_all()  # the pins are process-wide: no other test meets this one's


def test_the_fastest_agreeing_candidate_is_pinned_and_runs_unconfigured_calls(chain):
    a, layers, reference, calls = chain
    first, second, third = stream_gemm_configs.candidate_configs(a, layers[0][0])[:3]
    unbuildable = {k: v for k, v in first.items() if k != "SPLIT_K"}  # Triton refuses a missing meta-parameter
    time_ms, seen = clock([2.0, 1.0, 1.5])
    pick = gemm_tuning.tune("c_attn", reference, calls, [first, unbuildable, second, third], time_ms)
    assert (pick.ms, pick.config) == (1.0, second)
    assert seen == ["c_attn"] * 3  # the unbuildable one was never timed
    (key,) = stream_gemm_configs.pinned_configs()
    assert key[:4] == (N, K, torch.float16, torch.float16) and stream_gemm_configs.pinned_configs()[key] == second
    w, counters = layers[0]
    unconfigured = stream_gemm.stream_gemm(a, w, counters, torch.float32)
    assert torch.equal(unconfigured, stream_gemm.stream_gemm(a, w, counters, torch.float32, config=second))
    # the same rows as a view off TMA's 16-byte grid: the pinned tiles by per-thread loads, the same bits
    shifted = torch.empty(a.numel() + 1, dtype=a.dtype)[1:].view_as(a).copy_(a)
    assert second["TMA"] and not stream_gemm_configs.tma_fits(shifted, w)
    assert torch.equal(stream_gemm.stream_gemm(shifted, w, counters, torch.float32), unconfigured)


def test_products_off_the_reference_are_never_chosen(chain, caplog):
    a, layers, reference, calls = chain
    first, second = stream_gemm_configs.candidate_configs(a, layers[0][0])[:2]

    def skewed(config, pin=False):  # the second config's products with one tile never written
        out = calls(config, pin)
        if config is second:
            out[1][:, :32] = 0
        return out

    time_ms, seen = clock([2.0])
    assert gemm_tuning.tune("c_fc", reference, skewed, [first, second], time_ms).ms == 2.0
    assert seen == ["c_fc"]  # the skewed config was never timed
    assert "c_fc" in caplog.text and "products off cuBLAS's" in caplog.text
    assert list(stream_gemm_configs.pinned_configs().values()) == [first]
    with pytest.raises(ValueError, match="no config of 1 builds and agrees"):
        gemm_tuning.tune("c_fc", reference, skewed, [second], clock([])[0])


def test_candidates_fit_shared_memory_and_load_by_tma_only_where_it_may():
    a = torch.zeros(64, K, dtype=torch.float16)
    w = torch.zeros(N, K, dtype=torch.float16)
    configs = stream_gemm_configs.candidate_configs(a, w)
    assert configs and all(c["TMA"] for c in configs)
    hopper = 227 * 1024  # a CTA's shared memory on the H200 (the CPU's stand-in)

    def tiles(c: dict, weight_tiles: int = 1) -> int:  # bytes of the rows' and weights' tiles in flight
        return c["num_stages"] * c["BLOCK_K"] * (64 + weight_tiles * c["BLOCK_N"]) * 2

    assert all(tiles(c) <= hopper for c in configs)
    fused = stream_gemm_configs.candidate_configs(a, torch.zeros(2 * N, K, dtype=torch.float16), swiglu=True)
    assert fused and all(tiles(c, 2) <= hopper for c in fused)
    misaligned = torch.zeros(64 * K + 1, dtype=torch.float16)[1:].view(64, K)  # 2 bytes past an aligned start
    assert not any(c["TMA"] for c in stream_gemm_configs.candidate_configs(misaligned, w))
    fp8_weights = w.to(torch.float8_e4m3fn)  # widened in registers beside bfloat16 rows: per-thread loads
    assert not any(c["TMA"] for c in stream_gemm_configs.candidate_configs(a, fp8_weights))
    # the stream-K kernel for same-dtype operands without SwiGLU (it neither widens nor fuses)
    assert any("CTAS" in c for c in configs)
    assert not any("CTAS" in c for c in fused + stream_gemm_configs.candidate_configs(a, fp8_weights))


def test_agreement_is_relative_to_each_reference():
    g = torch.Generator().manual_seed(0)
    ref = [torch.randn(64, 96, generator=g) for _ in range(3)]
    rounded = [r.bfloat16() for r in ref]  # bfloat16 rounding: agrees
    assert gemm_tuning.agrees(ref, rounded)
    off = [r.clone() for r in ref]
    off[2][:, :8] = 0  # one layer's tile never written: does not
    assert not gemm_tuning.agrees(ref, off)


def test_each_gemm_shape_pins_its_fastest_config_timed_over_its_layers(
    small_dir, monkeypatch, tmp_path, caplog
) -> None:
    """tune_fp8_linears on the CPU (the split-K GEMM in Triton's interpreter, a clock the test
    gives): every FP8 block shape of the small model is timed over its layers, each GEMM behind
    the quantizing kernel that feeds it, and the faster of two candidates is pinned for its key.
    A restart pins the same configs from the kept file without timing any."""
    model = fp8.quantize_model(load_checkpoint(small_dir, dtype=torch.bfloat16, device="cpu")[1])
    for m in model.modules():  # the split-K tile counters a CUDA weight carries (none on the CPU)
        if isinstance(m, fp8.Fp8Linear):
            m.counters = torch.zeros(stream_gemm.counter_count(m.out_features), dtype=torch.int32)
    every = stream_gemm_configs.candidate_configs

    # a wide-tile split-K candidate, a stream-K one, two layers: the interpreter runs each program in turn
    def two(a: torch.Tensor, b: torch.Tensor, swiglu: bool = False) -> list[dict]:
        configs = every(a, b, swiglu)
        return [[c for c in configs if c.get("SPLIT_K") == 1][-1], next(c for c in configs if "CTAS" in c)]

    monkeypatch.setattr(stream_gemm_configs, "candidate_configs", two)
    model.transformer.blocks = model.transformer.blocks[:2]
    layer_counts = []

    def time_ms(name: str, calls) -> float:
        layer_counts.append(len(calls()))
        return [3.0, 2.0][(len(layer_counts) - 1) % 2]  # the second candidate of each shape is faster

    cache = TuningCache(tmp_path / "picks.json")
    caplog.set_level("INFO", logger="cde.gemm_tuning")
    try:
        chosen = gemm_tuning.tune_fp8_linears(model, cache, time_ms)
        assert caplog.text.count("(2 candidates; fastest split-K 3.000 ms, stream-K 2.000 ms)") == 4
        block = model.transformer.blocks[0]
        shapes = {(m.out_features, m.in_features) for m in block.modules() if isinstance(m, fp8.Fp8Linear)}
        assert chosen == {shape: 2.0 for shape in shapes} and len(shapes) == 4
        assert layer_counts == [len(model.transformer.blocks)] * 8
        pinned = stream_gemm_configs.pinned_configs()
        for n, k in shapes:
            key = (n, k, fp8_ops.E4M3, fp8_ops.E4M3, True, True, False, 0)  # plain launches on the CPU
            xq = torch.zeros(64, k, dtype=fp8_ops.E4M3)
            assert pinned[key] == two(xq, torch.zeros(n, k, dtype=fp8_ops.E4M3))[1]
        stream_gemm_configs.unpin_all()
        assert gemm_tuning.tune_fp8_linears(model, cache, never_timed) == chosen
        assert stream_gemm_configs.pinned_configs() == pinned
    finally:
        stream_gemm_configs.unpin_all()


def never_timed(name, calls):
    raise AssertionError(f"{name} timed again")


@pytest.fixture
def three(monkeypatch):
    """The first three candidates only: the interpreter runs every tile's program in turn."""
    every = stream_gemm_configs.candidate_configs

    def first_three(a: torch.Tensor, b: torch.Tensor, swiglu: bool = False) -> list[dict]:
        return every(a, b, swiglu)[:3]

    monkeypatch.setattr(stream_gemm_configs, "candidate_configs", first_three)
    return first_three


def test_a_kept_pick_is_pinned_untimed_while_it_holds(chain, three, tmp_path, caplog):
    """The pick one process tuned is pinned by the next without timing; one no longer among the
    candidates, or whose products no longer agree, or a file that does not parse, is tuned again
    and the entry replaced."""
    caplog.set_level("INFO", logger="cde.gemm_tuning")
    a, layers, reference, calls = chain
    w = layers[0][0]
    first, second, _third = three(a, w)
    cache = TuningCache(tmp_path / "gemm-tuning" / "gpu.json")
    time_ms, seen = clock([2.0, 1.0, 3.0])
    assert gemm_tuning.pin_fastest("c_attn", reference, calls, a, w, time_ms, cache) == 1.0 and len(seen) == 3
    stored = json.loads(cache.path.read_text())
    (key,) = stored
    assert "c_attn" in key and "float16[64, 512]" in key and stored[key]["config"] == second

    stream_gemm_configs.unpin_all()  # the next process
    assert gemm_tuning.pin_fastest("c_attn", reference, calls, a, w, never_timed, cache) == 1.0
    assert list(stream_gemm_configs.pinned_configs().values()) == [second]
    assert "kept in" in caplog.text

    # another chain (another name) is not served by this one's pick
    time_ms, seen = clock([5.0] * 3)
    assert gemm_tuning.pin_fastest("c_proj", reference, calls, a, w, time_ms, cache) == 5.0 and len(seen) == 3

    def skewed(config, pin=False):  # the kept config's products now off the reference
        out = calls(config, pin)
        if config == second:
            out[0][:, :32] = 0
        return out

    stream_gemm_configs.unpin_all()
    time_ms, seen = clock([3.0, 4.0])
    assert gemm_tuning.pin_fastest("c_attn", reference, skewed, a, w, time_ms, cache) == 3.0
    assert json.loads(cache.path.read_text())[key]["config"] == first  # replaced

    stored = json.loads(cache.path.read_text())
    stored[key]["config"] = {**first, "num_stages": 5}  # builds, but not a candidate (an older grid's)
    cache.path.write_text(json.dumps(stored))
    time_ms, seen = clock([6.0] * 3)
    assert gemm_tuning.pin_fastest("c_attn", reference, calls, a, w, time_ms, cache) == 6.0 and len(seen) == 3

    cache.path.write_text('{"half written')
    time_ms, seen = clock([7.0] * 3)
    assert gemm_tuning.pin_fastest("c_attn", reference, calls, a, w, time_ms, cache) == 7.0 and len(seen) == 3
    assert "unreadable" in caplog.text and json.loads(cache.path.read_text())[key]["ms"] == 7.0
    assert sorted(p.name for p in cache.path.parent.iterdir()) == ["gpu.json", "gpu.lock"]  # no temporary file left


def test_nothing_is_kept_without_a_file(chain, three):
    a, layers, reference, calls = chain
    w = layers[0][0]
    for _ in range(2):
        stream_gemm_configs.unpin_all()
        time_ms, seen = clock([1.0] * 3)
        assert gemm_tuning.pin_fastest("c_attn", reference, calls, a, w, time_ms, TuningCache(None)) == 1.0
        assert len(seen) == 3
