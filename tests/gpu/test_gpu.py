"""GPU tests (run on the H200 through scripts/gpu_run.sh): the FlexAttention paged kernel against
a dense reference, float32 parity with the official generator through the CUDA-graph path, and
zero recompiles once warm while steering/attribution toggle per request."""

from collections.abc import Callable

import pytest
import torch
from cde.kernels.flex_paged_attention import PACKED_OPTIONS, SINGLE_TILE_OPTIONS, PagedBlockMask, flex_paged_attention
from cde.kernels.paged_attention import dense_block_causal_reference
from cde.shared.protocol import AttributionSpec, GenerateRequest, SteeringSpec
from cde.worker.engine import Engine, EngineArgs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


# layout: (packed heads, kernel options); 8 heads per KV head packed into the engine's 128-row tiles,
# and into 16-row kernel blocks (the engine's choice for one unsplit item)
@pytest.mark.parametrize(
    "layout", [(1, None), (8, PACKED_OPTIONS), (8, SINGLE_TILE_OPTIONS)], ids=["per_head", "packed", "packed_16"]
)
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_flex_paged_attention_matches_dense(dtype, tol, splits, layout):
    torch.manual_seed(0)
    kvh, h, d, cache_pages = 4, 32, 128, 40
    lengths = [1, 3, 7, 2]  # blocks per request: mixed lengths in one batch
    perm = torch.randperm(cache_pages).tolist()  # non-contiguous pages
    seqs, off = [], 0
    for n in lengths:
        seqs.append(perm[off : off + n])
        off += n
    k_cache = torch.randn(kvh, cache_pages, 64, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(len(seqs), h, 64, d, device="cuda", dtype=dtype)  # the last block of each request
    table = torch.zeros(len(seqs), max(lengths), dtype=torch.long, device="cuda")
    for i, p in enumerate(seqs):
        table[i, : len(p)] = torch.tensor(p)
    mask = PagedBlockMask(len(seqs), cache_pages, "cuda", splits, *layout)
    mask.update(table, torch.tensor(lengths, device="cuda"))
    # static shapes, as the engine's graphs: a layout compiled after another must not turn its
    # head grouping into a symbol (FlexAttention's lowering rejects a symbolic group). The 12 cases
    # share one code object: past Dynamo's default limit of 8 variants the later ones would run
    # eagerly (unfused) unnoticed, so the limit is raised and hitting it fails.
    with torch._dynamo.config.patch(recompile_limit=16, fail_on_recompile_limit_hit=True):
        out = torch.compile(flex_paged_attention, dynamic=False)(q, k_cache, v_cache, mask)
    for i, pages in enumerate(seqs):
        k = k_cache[:, pages].reshape(kvh, -1, d)[None].double()
        v = v_cache[:, pages].reshape(kvh, -1, d)[None].double()
        t = k.shape[2]
        qq = torch.zeros(1, h, t, d, dtype=torch.float64, device="cuda")
        qq[:, :, -64:] = q[i].double()
        ref = dense_block_causal_reference(qq, k, v)[0, :, -64:]
        err = (out[i].double() - ref).norm() / ref.norm()
        assert err < tol, (i, float(err))


def test_float32_greedy_matches_official_generator_on_gpu(small_dir):
    from steerling.configs.generation import GenerationConfig

    from tests.oracle import official_generator

    gen = official_generator(small_dir)
    gen.model.cuda()
    gen.device = torch.device("cuda")
    engines = [Engine(EngineArgs(str(small_dir), device="cuda", dtype="float32", kv_splits=s)) for s in (1, 8)]
    g = torch.Generator().manual_seed(5)
    for n in (64, 128, 192):
        prompt = torch.randint(0, 100000, (n,), generator=g).tolist()
        ref = gen.generate_full(
            torch.tensor([prompt]),
            GenerationConfig(
                max_new_tokens=128, steps=128, temperature=0, use_entropy_sampling=False, top_p=0, repetition_penalty=1
            ),
        )
        for engine in engines:  # unsplit, and split-KV 8 ways at batch 1
            ours = engine.generate([GenerateRequest(f"p{n}", prompt, max_tokens=128)])[f"p{n}"]
            assert ours == ref.tokens[n:].tolist()


def test_long_context_passes_replay_the_split_graph_and_decode_as_unsplit(tmp_path):
    """Auto split-KV (the default): a one-request pass over >= LONG_CONTEXT_PAGES pages replays
    the bucket's split graph, and decodes the tokens of the engine that never splits."""
    from cde.worker.checkpoint import make_model
    from cde.worker.cuda_graphs import AUTO_SPLITS, LONG_CONTEXT_PAGES

    model = make_model("small", tmp_path / "long", seed=3, overrides={"context_len": 4096})
    auto, unsplit = (Engine(EngineArgs(str(model), device="cuda", dtype="float32", kv_splits=s)) for s in (0, 1))
    replays: dict = {}  # replays per exact-family bucket (size, ways)
    for (size, split, ways), bucket in auto.runner.forward.graphed.buckets.items():
        if not split and bucket.graph is not None:
            replay = bucket.graph.replay
            bucket.graph.replay = lambda key=(size, ways), replay=replay: (
                replays.update({key: replays.get(key, 0) + 1}),
                replay(),
            )[1]
    prompt = torch.randint(0, 100000, (64 * LONG_CONTEXT_PAGES + 20,), generator=torch.Generator().manual_seed(6))
    req = lambda: [GenerateRequest("long", prompt.tolist(), max_tokens=64)]
    assert auto.generate(req())["long"] == unsplit.generate(req())["long"]
    # the 64 denoising passes over >= 33 pages: the first rides the prompt's prefill pass (a bucket of
    # 64 items, never split); every other one splits (bucket 1, or 2 where it carries another item)
    split_passes = sum(c for (size, ways), c in replays.items() if ways == AUTO_SPLITS.get(size))
    assert split_passes == 63, replays


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_no_compile_or_capture_after_startup_while_features_and_batch_sizes_change(small_dir, quantization):
    """The engine warms every graph bucket at startup: batches of any size, with steering and
    attribution toggled per request, then compile nothing and capture nothing. With fp8 the
    buckets run both paths (weight-only at one item, FP8 GEMMs above)."""
    from torch._dynamo.utils import counters

    engine = Engine(
        EngineArgs(str(small_dir), device="cuda", dtype="bfloat16", max_running=24, quantization=quantization)
    )
    before, buckets = dict(counters["stats"]), set(engine.runner.forward.graphed.buckets)

    def wave(tag, n, prompt_blocks=1):
        reqs = [
            GenerateRequest(
                f"{tag}{i}",
                [7 + i] * (64 * prompt_blocks + i),
                max_tokens=64 + 8 * i,
                steering=SteeringSpec(concepts=[i], inject_layer=1 + i % 3) if i % 2 else None,
                attribution=AttributionSpec() if i % 3 == 0 else None,
            )
            for i in range(n)
        ]
        engine.generate(reqs)

    wave("a", 8)
    wave("b", 1)
    wave("c", 3, prompt_blocks=5)  # staggered finishes: passes of every size from 3 down to 1
    wave("d", 20, prompt_blocks=2)  # 40 prefill items in one pass (bucket 40), then 20 steps (24)
    assert dict(counters["stats"]) == before
    assert set(engine.runner.forward.graphed.buckets) == buckets


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_flashblock_split_matches_unsplit_attention(dtype, tol):
    """FlashBlock's split (FlexAttention over the cached pages with its log-sum-exp, dense
    attention over the item's own block, merged) equals the unsplit kernel; a first block (no
    cached pages at all) included."""
    from cde.kernels.flashblock import FlashBlockBatch, external_pages, split_attention
    from cde.shared.config import ATTN_REFRESH

    torch.manual_seed(1)
    kvh, h, d, cache_pages = 4, 32, 128, 40
    lengths = [1, 3, 7, 2]
    perm = torch.randperm(cache_pages).tolist()
    table = torch.zeros(len(lengths), max(lengths), dtype=torch.long, device="cuda")
    off = 0
    for i, n in enumerate(lengths):
        table[i, :n] = torch.tensor(perm[off : off + n])
        off += n
    n_pages = torch.tensor(lengths, device="cuda")
    k_cache = torch.randn(kvh, cache_pages, 64, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(len(lengths), h, 64, d, device="cuda", dtype=dtype)
    own = table.gather(1, (n_pages - 1)[:, None])[:, 0]
    k_own, v_own = k_cache[:, own].transpose(0, 1), v_cache[:, own].transpose(0, 1)
    flex = torch.compile(flex_paged_attention)
    full_mask = PagedBlockMask(len(lengths), cache_pages, "cuda")
    full_mask.update(table, n_pages)
    unsplit = flex(q, k_cache, v_cache, full_mask)
    mode = torch.full_like(n_pages, ATTN_REFRESH)
    ext_mask = PagedBlockMask(len(lengths), cache_pages, "cuda")
    ext_mask.update(table, external_pages(n_pages, mode))
    ext, lse = flex(q, k_cache, v_cache, ext_mask, return_lse=True)
    # the kernel's log-sum-exp is the natural-log one the merge expects
    for i, n in enumerate(lengths[:3]):
        if n > 1:
            keys = k_cache[:, table[i, : n - 1]].reshape(kvh, -1, d).double().repeat_interleave(h // kvh, 0)
            ref_lse = (q[i].double() @ keys.transpose(-1, -2) / d**0.5).logsumexp(-1)
            assert (lse[i].double() - ref_lse).abs().max() < 1e-3 * ref_lse.abs().max()
    rows = torch.arange(len(lengths), device="cuda")
    cache = (
        torch.zeros(len(lengths), h, 64, d, device="cuda", dtype=dtype),
        torch.zeros(len(lengths), h, 64, device="cuda"),
    )
    out = split_attention(q, k_own, v_own, ext, lse, cache, FlashBlockBatch(mode, rows, rows, []))
    err = ((out.double() - unsplit.double()).norm() / unsplit.double().norm()).item()
    assert err < tol, err
    assert torch.equal(cache[0], ext)


def test_flashblock_float32_split_and_mixed_batch_exact_on_gpu(small_dir):
    """Issue 6 criteria 1 and 4 through the CUDA-graph path: split without reuse gives the exact
    tokens, and exact requests sharing batches with reusing ones are untouched."""
    from cde.shared.protocol import FlashBlockSpec

    engine = Engine(EngineArgs(str(small_dir), device="cuda", dtype="float32", max_running=8))
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 100000, (n,), generator=g).tolist() for n in (64, 100, 150, 30)]

    def run(tag, fb):
        return {
            k[len(tag) :]: v
            for k, v in engine.generate(
                [GenerateRequest(f"{tag}{i}", p, max_tokens=130, flashblock=fb) for i, p in enumerate(prompts)]
            ).items()
        }

    exact = run("e", False)
    assert run("s", FlashBlockSpec(tau=0, max_reuse=0)) == exact
    mixed = engine.generate(
        [
            GenerateRequest(f"{kind}{i}", p, max_tokens=130, flashblock=fb)
            for i, p in enumerate(prompts)
            for kind, fb in (("x", False), ("f", FlashBlockSpec(2, 63)))
        ]
    )
    assert {k[1:]: v for k, v in mixed.items() if k.startswith("x")} == exact


@pytest.fixture(scope="module")
def logits_8b(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], Callable]:
    """The 8b shape: CDE's bfloat16 logits for an active block (context written by prefill), the
    official full forward's in bfloat16, the official float32 forward's (the exact result), and
    CDE's with --quantization fp8: through the CUDA graphs (that pass has two items, 128 rows: the
    FP8 GEMM path) and, without graphs, weight-only at every size.
    $CDE_8B_DIR: a random 8b bf16 checkpoint already written (scripts/gpu_run.sh shares one)."""
    import gc
    import os

    from cde.worker.checkpoint import make_model

    from tests.parity.test_bf16_logits import engine_logits, official_logits
    from tests.worker.test_fp8 import active_block_logits

    model_dir = os.environ.get("CDE_8B_DIR") or make_model(
        "8b", tmp_path_factory.mktemp("m8b"), dtype="bfloat16", device="cuda"
    )
    prompt = torch.randint(0, 100000, (64,), generator=torch.Generator().manual_seed(7)).tolist()
    out = {}
    for name, fn in (
        ("ours", lambda: engine_logits(model_dir, "bfloat16", prompt, device="cuda")),
        ("official", lambda: official_logits(model_dir, torch.bfloat16, prompt, device="cuda")),
        ("exact", lambda: official_logits(model_dir, torch.float32, prompt, device="cuda")),
        ("fp8", lambda: active_block_logits(model_dir, "fp8", device="cuda")),
        (
            "fp8_weight_only",
            lambda: active_block_logits(model_dir, "fp8", weight_only_rows=1 << 30, device="cuda", cuda_graphs=False),
        ),
    ):
        try:
            out[name] = fn()
        except Exception as exc:  # one failing forward must not hide the others' figures
            print(f"8b logits: {name} failed: {type(exc).__name__}: {exc}")
        gc.collect()
        torch.cuda.empty_cache()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    if {"ours", "official", "exact"} <= set(out):
        print(
            f"8b bf16 logits: CDE vs official {rel(out['ours'], out['official']):.2e}; vs float32: "
            f"CDE {rel(out['ours'], out['exact']):.2e}, official {rel(out['official'], out['exact']):.2e}"
        )
    return out, rel


def test_bfloat16_8b_logits_at_least_as_close_to_exact_as_official(logits_8b: tuple[dict, Callable]) -> None:
    """Issue 16: CDE's bfloat16 forward is at least as close to the float32 forward as the
    official bfloat16 forward (H200, 2026-11-30: 1.67e-2 against 1.81e-2). CDE and the official
    bfloat16 forwards differ from each other by about 2.2e-2: two roundings taken in different
    orders, neither of them an error."""
    out, rel = logits_8b
    assert out["ours"].shape == out["official"].shape == out["exact"].shape
    assert rel(out["ours"], out["exact"]) <= rel(out["official"], out["exact"])


@pytest.mark.parametrize("path", ["fp8", "fp8_weight_only"])
def test_fp8_8b_logits_deviation_from_bfloat16(logits_8b: tuple[dict, Callable], path: str) -> None:
    """The fp8 8b's deviation from CDE's bfloat16 forward, reported (relative error, mean KL,
    greedy agreement) and bounded: e4m3 keeps 3 mantissa bits to bfloat16's 8 (2^5 = 32 times
    coarser rounding), so the fp8 logits may be at most 32 times as far from bfloat16 as the
    bfloat16 ones are from float32 (14x on the small preset on the CPU); random weights amplify
    rounding through 32 layers, so the greedy and KL bounds only rule out a broken path (chance
    agreement is 1e-5)."""
    from cde.worker.fp8 import deviation

    out, rel = logits_8b
    dev = deviation(out["ours"], out[path])
    bf16_error = rel(out["ours"], out["exact"])
    print(
        f"8b {path} vs bf16: relative error {dev['rel_error']:.3e}, mean KL {dev['mean_kl']:.3e}, "
        f"greedy agreement {dev['greedy_agreement']:.3f} (bf16 vs fp32 {bf16_error:.2e})"
    )
    assert 0 < dev["rel_error"] <= 32 * bf16_error
    assert dev["greedy_agreement"] >= 0.3 and dev["mean_kl"] < 1.0


@pytest.mark.parametrize("rows", [64, 5])
@pytest.mark.parametrize("n,k", [(5120, 4096), (4096, 16384), (32768, 4096)])  # c_attn, MLP c_proj, c_fc
def test_bf16_stream_gemm_matches_cublas_at_every_split(n: int, k: int, rows: int) -> None:
    """kernels/stream_gemm.py in bfloat16 at every split-K way, against F.linear (cuBLAS): the
    same product to bfloat16 rounding, the counters zero after every call, the same bits twice,
    and again with PREFETCH (programmatic dependent launch, weight tiles to L2 first), with the
    tiles loaded by TMA, and with the CTA timeline the sweep's --timeline reads."""
    from cde.kernels.stream_gemm import MAX_SPLIT_K, counter_count, stream_gemm

    torch.manual_seed(0)
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    ref = torch.nn.functional.linear(a, w).float()
    counters = torch.zeros(counter_count(n), dtype=torch.int32, device="cuda")
    for split in (1, 2, 4, MAX_SPLIT_K, None):  # None: the autotuner's choice
        tiles = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "SWAP_AB": False}
        cfg = None if split is None else {**tiles, "SPLIT_K": split}
        got = stream_gemm(a, w, counters, torch.bfloat16, config=cfg)
        assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2, split
        assert not counters.any() and torch.equal(stream_gemm(a, w, counters, torch.bfloat16, config=cfg), got)
        if cfg is not None:  # launched early (PDL) with tiles prefetched, tiles by TMA: the same bits
            assert torch.equal(stream_gemm(a, w, counters, torch.bfloat16, config=cfg, prefetch=4), got), split
            by_tma = {**cfg, "TMA": True}
            assert torch.equal(stream_gemm(a, w, counters, torch.bfloat16, config=by_tma), got), split
            assert torch.equal(stream_gemm(a, w, counters, torch.bfloat16, config=by_tma, prefetch=4), got), split
            # the timeline diagnostic: the same bits, and one row per CTA with start <= loop end <= end
            book = torch.zeros(counter_count(n) * MAX_SPLIT_K, 4, dtype=torch.int64, device="cuda")
            assert torch.equal(stream_gemm(a, w, counters, torch.bfloat16, config=cfg, timeline=book), got)
            ctas = book[book[:, 0] > 0].cpu()
            assert len(ctas) == -(-n // 64) * split, split
            assert (ctas[:, 0] <= ctas[:, 1]).all() and (ctas[:, 1] <= ctas[:, 2]).all()
            assert (ctas[:, 3] < torch.cuda.get_device_properties(0).multi_processor_count).all()


@pytest.mark.parametrize("rows", [64, 5])
@pytest.mark.parametrize("n,k", [(5120, 4096), (4096, 4096), (4096, 16384), (32768, 4096)])  # the 8b's four
def test_stream_k_matches_cublas_on_every_sm(n: int, k: int, rows: int) -> None:
    """kernels/stream_k.py on one program per SM, bfloat16 and FP8, against cuBLAS (F.linear,
    torch._scaled_mm): the same product to bfloat16 rounding, the counters zero after every call,
    the same bits twice, launched early (PDL) with weight tiles prefetched, and by per-thread
    loads as by TMA."""
    from cde.kernels import fp8_ops
    from cde.kernels.stream_gemm import counter_count, stream_gemm
    from cde.kernels.stream_gemm_configs import candidate_configs

    torch.manual_seed(2)
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    xq, xs = fp8_ops.quantize_rows(a)
    wq, ws = fp8_ops.quantize_rows(w)
    cases = {
        "bf16": ((a, w), None, torch.nn.functional.linear(a, w).float()),
        "fp8": (
            (xq, wq),
            (xs[:, 0], ws[:, 0]),
            torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16).float(),
        ),
    }
    counters = torch.zeros(counter_count(n), dtype=torch.int32, device="cuda")
    for name, (operands, scales, ref) in cases.items():
        for cfg in [c for c in candidate_configs(*operands) if "CTAS" in c][::3]:  # on one program per SM
            cfg = {**cfg, "TMA": False}
            got = stream_gemm(*operands, counters, torch.bfloat16, scales=scales, config=cfg)
            assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2, (name, cfg)
            assert not counters.any(), (name, cfg)
            again = stream_gemm(*operands, counters, torch.bfloat16, scales=scales, config=cfg)
            assert torch.equal(again, got), (name, cfg)
            for tma, prefetch in ((False, 2), (True, 0), (True, 2)):
                out = stream_gemm(
                    *operands, counters, torch.bfloat16, scales=scales, config={**cfg, "TMA": tma}, prefetch=prefetch
                )
                assert torch.equal(out, got), (name, cfg, tma, prefetch)


@pytest.fixture
def autotuner_only():
    """No config pinned by an earlier test's warm-up tuning (the 8b logits' bf16 engine pins c_fc's
    SwiGLU config, its fp8 engine the FP8 shapes): calls without a config go to the autotuner, and a
    test sees only the pins it made. The pins come back afterwards."""
    from cde.kernels import stream_gemm_configs

    pinned = stream_gemm_configs.pinned_configs()
    stream_gemm_configs.unpin_all()
    yield
    for key, config in pinned.items():
        stream_gemm_configs.pin_config(key, config)


@pytest.mark.parametrize("rows", [64, 5])
def test_stream_swiglu_kernel_matches_the_two_steps(rows: int, autotuner_only) -> None:
    """c_fc of the 8b with silu(gate) * up in the split-K GEMM's epilogue, autotuned, against
    F.linear (cuBLAS) then the activation: the same values to bfloat16 rounding."""
    from cde.kernels.stream_gemm import counter_count, stream_gemm, tuned_launch_configs
    from cde.kernels.stream_ops import swiglu

    torch.manual_seed(1)
    a = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * 16384, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    ref = swiglu(torch.nn.functional.linear(a, w)).float()
    counters = torch.zeros(counter_count(16384), dtype=torch.int32, device="cuda")
    got = stream_gemm(a, w, counters, torch.bfloat16, swiglu=True)
    assert got.shape == (rows, 16384) and ((got.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert not counters.any() and torch.equal(stream_gemm(a, w, counters, torch.bfloat16, swiglu=True), got)
    # the autotuned pick again with its tiles loaded by TMA instead of per thread: the same bits
    (tuned,) = [c for key, c in tuned_launch_configs().items() if key[:6] == (16384, 4096, False, False, True, 0)]
    by_tma = {**tuned, "TMA": True}
    assert torch.equal(stream_gemm(a, w, counters, torch.bfloat16, config=by_tma, swiglu=True), got)


def test_stream_linears_calibrate_and_keep_the_outputs(small_dir) -> None:
    """worker/stream_linear.py on the GPU: every block shape timed on both kernels, and the model's
    outputs with the chosen kernels within bfloat16 rounding of cuBLAS everywhere."""
    from cde.kernels import stream_gemm_configs
    from cde.worker import stream_linear
    from cde.worker.checkpoint import load_checkpoint

    model = load_checkpoint(small_dir, dtype=torch.bfloat16, device="cuda")[1]
    x = torch.randn(1, 64, model.cfg.n_embd, device="cuda", dtype=torch.bfloat16)
    block = model.transformer.blocks[0]
    with torch.inference_mode():
        ref = block.mlp(x).float()
    choices = stream_linear.install(model)
    linears, mlp = choices["linears"], choices["swiglu"]
    assert len(linears) == 4 and all(c["cublas_ms"] > 0 and c["stream_ms"] > 0 for c in linears.values())
    assert mlp["unfused_ms"] > 0 and mlp["fused_ms"] > 0
    # every shape's config was timed over its layers and pinned (worker/gemm_tuning.py), and the fused MLP's
    pinned = {(key[0], key[1], key[6]) for key in stream_gemm_configs.pinned_configs() if key[2] == torch.bfloat16}
    assert {(n, k, False) for n, k in linears} | {(block.mlp.c_proj.in_features, x.shape[-1], True)} <= pinned
    for fused in (False, True):  # whichever was faster: the Triton GEMMs' outputs, unfused and fused
        for m in model.modules():
            if isinstance(m, stream_linear.StreamLinear):
                m.stream = True
            if isinstance(m, stream_linear.StreamMLP):
                m.fused = fused
        with torch.inference_mode():  # as the engine runs (where autograd records, the ops step aside)
            got = block.mlp(x).float()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2, fused


def test_fp8_gemms_tuned_over_their_layers_keep_the_outputs(small_dir, tmp_path, autotuner_only) -> None:
    """worker/gemm_tuning.py's tune_fp8_linears on the GPU: every FP8 block shape timed over its
    layers and its config pinned; one request's MLP and attention projections with the pinned
    configs within bfloat16 rounding of the autotuner's. A restart pins the kept picks untimed."""
    from cde.kernels import stream_gemm_configs
    from cde.shared.home import cde_home
    from cde.worker import fp8, gemm_tuning
    from cde.worker.checkpoint import load_checkpoint
    from cde.worker.gemm_tuning_cache import TuningCache

    model = fp8.quantize_model(load_checkpoint(small_dir, dtype=torch.bfloat16, device="cuda")[1])
    x = torch.randn(1, 64, model.cfg.n_embd, device="cuda", dtype=torch.bfloat16)
    block = model.transformer.blocks[0]
    with torch.inference_mode():
        before = [block.mlp(x).float(), block.attn.c_attn(x).float()]
    cache = TuningCache(tmp_path / "picks.json")
    chosen = gemm_tuning.tune_fp8_linears(model, cache)
    assert len(chosen) == 4 and all(ms is not None and ms > 0 for ms in chosen.values())

    def fp8_pins() -> dict:
        return {k: c for k, c in stream_gemm_configs.pinned_configs().items() if k[3] == torch.float8_e4m3fn}

    pins = fp8_pins()
    assert set(chosen) <= {key[:2] for key in pins}
    with torch.inference_mode():
        after = [block.mlp(x).float(), block.attn.c_attn(x).float()]
    for ref, got in zip(before, after):
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2

    def never(name, calls):
        raise AssertionError(f"{name} timed again")

    stream_gemm_configs.unpin_all()  # a restart: the same picks from the file, none timed
    assert gemm_tuning.tune_fp8_linears(model, cache, never) == chosen and fp8_pins() == pins
    assert TuningCache.for_device(torch.device("cuda")).path.parent == cde_home() / "gemm-tuning"


@pytest.mark.parametrize("weight_only_rows", [0, 64])  # one item on FP8 GEMMs; one item weight-only
@pytest.mark.parametrize("n,k", [(5120, 4096), (4096, 16384)])  # the 8b's c_attn and MLP c_proj
def test_fp8_linear_on_gpu_matches_its_cpu_emulation(n: int, k: int, weight_only_rows: int) -> None:
    """The Triton GEMM (one item: 64 rows, with quantized or bfloat16 rows) and torch._scaled_mm
    (more), eager and compiled, against the float32 emulation the CPU tests check (run on the CPU),
    on the same quantized weight and inputs."""
    from cde.worker.fp8 import Fp8Linear, path_for_rows

    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(lin.weight, std=0.02)
    layer = Fp8Linear.from_linear(lin, weight_only_rows)
    emulated = Fp8Linear(layer.weight.cpu(), layer.scale.cpu(), weight_only_rows)
    assert emulated.emulate and not layer.emulate
    assert [path_for_rows(64 * items, 0, k) for items in (1, 2, 32)] == ["triton", "cublas", "cublas"]
    compiled = torch.compile(layer)
    for items in (1, 2, 32):
        x = torch.randn(items, 64, k, device="cuda", dtype=torch.bfloat16)
        ref = emulated(x.cpu()).float().cuda()
        for name, fn in (("eager", layer), ("compiled", compiled)):
            got = fn(x)
            assert got.dtype == torch.bfloat16 and got.shape == (items, 64, n)
            err = ((got.float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (items, name, err)
        exact = lin(x).float()
        assert ((ref - exact).norm() / exact.norm()).item() < 6e-2


@pytest.mark.parametrize("steer", [False, True])
@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_fp8_add_norm_quantize_kernel_matches_the_cpu_op(rows: int, steer: bool) -> None:
    """The post-norm residual's fused Triton kernel against cde::add_norm_quantize's definition on
    the CPU (bfloat16, the 8b's width). The norm is rounded to bfloat16 before the sum (the model's
    numerics); the GPU's rsqrt can flip that rounding by one step of the norm, which the sum keeps even
    where x cancels it, so a residual may differ by one step of the norm and one of the sum, and a
    row's scale by what that does to its largest value. e4m3 values at most one step apart. With
    the steering (a block's end: gate * inject, the gate per item of 64 rows, every other item's
    0), one more rounding of the sum."""
    from cde.kernels.fp8_ops import add_norm_quantize
    from cde.kernels.stream_ops import rms_norm

    torch.manual_seed(2)
    x, delta = (torch.randn(rows, 4096, device="cuda") * s for s in (2.0, 0.3))
    x, delta = x.to(torch.bfloat16), delta.to(torch.bfloat16)
    w = (torch.rand(4096, device="cuda") + 0.5).to(torch.bfloat16)
    items = max(1, rows // 64)
    inject = (torch.randn(rows, 4096, device="cuda") * 0.5).to(torch.bfloat16) if steer else None
    gate = (torch.arange(items, device="cuda") % 2 == 0).to(torch.bfloat16) if steer else None
    out, q, scale = add_norm_quantize(x, delta, w, 1e-5, inject, gate)
    cpu = [None if t is None else t.cpu() for t in (inject, gate)]
    ref_out, ref_q, ref_scale = add_norm_quantize(x.cpu(), delta.cpu(), w.cpu(), 1e-5, *cpu)
    normed = rms_norm(delta.cpu(), w.cpu(), 1e-5).float()
    # a bfloat16 step is <= 2^-7 of its value: the norm's, the sum's and (steering) the sum before it
    step = 2**-7 * (normed.abs() + ref_out.float().abs() + (x.cpu().float() + normed).abs() * steer)
    assert ((out.cpu().float() - ref_out.float()).abs() <= step).all()
    assert (out.cpu() != ref_out).float().mean().item() < 1e-3
    assert torch.allclose(scale.cpu(), ref_scale, rtol=2**-6)
    step = ref_q.float().abs().clamp(min=2**-6) * 2**-3
    assert ((q.cpu().float() - ref_q.float()).abs() <= step + 2**-9).all()
    assert (q.cpu().float() != ref_q.float()).float().mean().item() < 1e-2


@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_fp8_silu_mul_quantize_kernel_matches_the_cpu_op(rows: int) -> None:
    """The fused Triton kernel against cde::silu_mul_quantize's float32 definition on the CPU:
    the same scales, and e4m3 values that differ at most by a rounding tie (one e4m3 step)."""
    from cde.kernels.fp8_ops import silu_mul_quantize

    torch.manual_seed(1)
    x = (torch.randn(rows, 2 * 16384, device="cuda") * 2).to(torch.bfloat16)
    q, scale = silu_mul_quantize(x)
    ref_q, ref_scale = silu_mul_quantize(x.cpu())
    assert torch.allclose(scale.cpu(), ref_scale, rtol=1e-6, atol=0)
    differ = q.cpu().float() != ref_q.float()
    assert differ.float().mean().item() < 1e-4
    step = ref_q.float().abs().clamp(min=2**-6) * 2**-3
    assert ((q.cpu().float() - ref_q.float()).abs() <= step + 2**-9).all()


@pytest.mark.parametrize("items", [1, 32])
def test_fp8_heads_quantize_kernel_matches_the_cpu_op(items: int) -> None:
    """Attention's output [N, 32 heads, 64, 128] (the 8b's; heads outermost at 32 items) joined per
    token and quantized by the Triton kernel, against cde::heads_quantize's definition on the CPU:
    the same scales, e4m3 values at most one step apart where the two roundings to e4m3 differ (1.9e-4
    of the values at 32 items on the H200, 2026-12-05; under 1e-4 at one item)."""
    from cde.kernels.fp8_ops import heads_quantize

    torch.manual_seed(5)
    y = (torch.randn(32, items, 64, 128, device="cuda") * 2).to(torch.bfloat16).transpose(0, 1)
    q, scale = heads_quantize(y)
    ref_q, ref_scale = heads_quantize(y.cpu())
    assert q.shape == (items * 64, 4096)
    assert torch.allclose(scale.cpu(), ref_scale, rtol=1e-6, atol=0)
    assert (q.cpu().float() != ref_q.float()).float().mean().item() < 1e-3
    step = ref_q.float().abs().clamp(min=2**-6) * 2**-3
    assert ((q.cpu().float() - ref_q.float()).abs() <= step + 2**-9).all()


@pytest.mark.parametrize("items", [1, 32])
def test_qkv_rope_kernel_matches_the_model_path_in_bfloat16(items: int) -> None:
    """cde::qkv_rope_write on the 8b's attention shape against `Attention.qkv` + `write_kv` (the
    path the parity tests hold to the official package): within a bfloat16 rounding, q packed
    8 heads per KV head, k and v in their pages and nothing else written."""
    from cde.kernels.paged_attention import write_kv
    from cde.kernels.qkv_rope import qkv_rope_write
    from cde.shared.config import PAGE, ModelConfig
    from cde.worker.model import Attention
    from cde.worker.rope import rope_tables

    torch.manual_seed(3)
    cfg = ModelConfig(n_layers=1, n_head=32, n_kv_heads=4, n_embd=4096, context_len=64 * PAGE)
    attn = Attention(cfg).cuda().to(torch.bfloat16)
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(items, PAGE, cfg.n_embd, device="cuda", dtype=torch.bfloat16)
    cos, sin = rope_tables(cfg, cfg.context_len, "cuda")
    pos = torch.randint(0, 64, (items, 1), device="cuda") * PAGE + torch.arange(PAGE, device="cuda")
    pages = torch.randperm(2 * items, device="cuda")[:items]
    cache = [torch.randn(4, 2 * items, PAGE, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv"]
    expected = [c.clone() for c in cache]
    with torch.no_grad():
        q, k, v = attn.qkv(x, cos[pos][:, None], sin[pos][:, None])
        write_kv(expected[0], k, pages)
        write_kv(expected[1], v, pages)
        out = qkv_rope_write(
            attn.c_attn(x), attn.q_norm.weight, attn.k_norm.weight, cos[pos], sin[pos], *cache, pages,
            cfg.clip_qkv, cfg.norm_eps, cfg.n_head, 8,
        )  # fmt: skip
    torch.cuda.synchronize()
    packed = q.view(items, 4, 8, PAGE, 128).transpose(0, 1)
    for got, want in ((out, packed), *zip(cache, expected)):
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=8e-3)  # one bf16 step
        assert (got != want).float().mean().item() < 0.02


def test_row_confidence_kernel_matches_softmax_max_and_argmax() -> None:
    from cde.kernels.row_confidence import row_confidence

    torch.manual_seed(2)
    x = (torch.randn(300, 100352, device="cuda") * 4).to(torch.bfloat16)
    x[:, 100281:] = float("-inf")  # the padding columns and banned ids
    x[:7, :50000] = float("-inf")  # a first half all -inf: the kernel's lanes that see only -inf
    x[7, 5] = 80.0  # one dominant logit: confidence ~1
    x[8, [70000, 3, 2051]] = 90.0  # tied maxima: the first column, as torch.argmax
    x[9] = float("-inf")  # all banned: column 0
    ref = torch.softmax(x[:9].double(), -1).amax(-1).float()
    # 300 rows: one chunk per row; 10 rows (a one-request pass has at most 64): ~25 chunks a row
    for got, top in (row_confidence(x), row_confidence(x[:10])):
        assert torch.allclose(got[:9], ref, rtol=1e-5, atol=0)
        assert got[7].item() > 0.999
        assert torch.equal(top, x[: len(top)].float().argmax(-1))
        assert top[8:10].tolist() == [3, 0]


def test_attribution_overlapped_on_gpu_equals_the_uncaptured_path(tiny_dir):
    """The CUDA path runs attribution as captured graphs on a side stream while the next pass is
    already launched; its records equal those of the same engine without CUDA graphs (float32),
    for concurrent requests committing one, two and three tokens per step, and the tokens equal
    the CPU engine's. (Saturated sigmoid weights tie exactly, and which tied concept comes first
    is the device's top-k order: GPU is compared with GPU.)"""

    def run(device, graphs=True):
        engine = Engine(EngineArgs(str(tiny_dir), device=device, dtype="float32", max_running=4, cuda_graphs=graphs))
        reqs = [
            GenerateRequest(
                f"r{k}",
                [300 + 7 * i + k for i in range(40 + 30 * k)],
                max_tokens=96,
                tokens_per_step=1 + k,
                attribution=AttributionSpec(),
            )
            for k in range(3)
        ]
        for r in reqs:
            engine.add_request(r)
        out = {r.request_id: ([], []) for r in reqs}
        while engine.has_work():
            for res in engine.step():
                out[res.request_id][0].extend(res.token_ids)
                out[res.request_id][1].extend(res.attribution)
        return out

    graphed, eager, cpu = run("cuda"), run("cuda", graphs=False), run("cpu")
    for rid, (tokens, records) in eager.items():
        assert graphed[rid][0] == tokens == cpu[rid][0] and len(graphed[rid][1]) == len(records) == 96
        for g, e in zip(graphed[rid][1], records):
            assert (g["token_id"], g["position"], g["step"]) == (e["token_id"], e["position"], e["step"])
            for head in ("known", "discovered"):
                assert [t[0] for t in g[head]] == [t[0] for t in e[head]], (rid, e["position"], head)
                assert torch.allclose(
                    torch.tensor([t[1:] for t in g[head]]), torch.tensor([t[1:] for t in e[head]]), rtol=1e-4, atol=1e-5
                )
            assert abs(g["target_logit"] - e["target_logit"]) < 1e-4 and abs(g["epsilon"] - e["epsilon"]) < 1e-3


def test_prefix_cache_on_equals_off_through_cuda_graphs(small_dir):
    """Issue 30 through the CUDA-graph path (float32): the CPU test's requests (shares of 0, some and
    all full pages; steered, attributed, input-attributed, FlashBlock, constrained, sampled) give
    with the prefix cache what they give without it, in one batch and again later."""
    from tests.worker.test_prefix_cache_exact import assert_same, requests, run

    def engine(cache: bool) -> Engine:
        return Engine(EngineArgs(str(small_dir), device="cuda", dtype="float32", max_running=8, prefix_cache=cache))

    plain = run(engine(False), requests(0))
    cached = engine(True)
    for round_ in (1, 2):
        got = run(cached, requests(round_))
        for name, blocks in plain.items():
            # 1e-5: a shared page's K/V was written by another request's prefill, and cuBLAS's
            # float32 GEMMs round differently for another row count (measured: 1.02e-6 of a logit of 13)
            assert_same(got[name], blocks, f"{name}, round {round_}", rtol=1e-5)
    assert cached.stats().cache_hit_tokens > 0


def test_async_scheduling_equals_planning_after_the_picks_through_cuda_graphs(small_dir):
    """worker/plan_ahead.py through the CUDA graphs (float32): the picks completing the pass
    planned ahead on the device, in the graph's token buffer and the selection grid, give what
    planning after them gives, for the CPU test's mix of requests (sampled, penalized, steered,
    attributed per step and per block, logprobs, 1 to 64 tokens a step) arriving over time, and
    for blocks completed at every pass."""
    from tests.worker.test_plan_ahead import _mixed, _run, _same

    args = {"device": "cuda", "dtype": "float32", "max_running": 8}
    ref, _ = _run(small_dir, _mixed(10), ahead=False, stagger=3, **args)
    ours, engine = _run(small_dir, _mixed(10), ahead=True, stagger=3, **args)
    _same(ours, ref, rel=1e-4)  # another LM-head row count: cuBLAS rounds differently
    assert engine.passes_planned_ahead > engine.forward_passes // 2

    def whole_blocks():
        return [
            GenerateRequest(f"b{i}", [9 + i] * 30, max_tokens=256, tokens_per_step=64, attribution=AttributionSpec())
            for i in range(3)
        ]

    ref, _ = _run(small_dir, whole_blocks(), ahead=False, **args)
    ours, engine = _run(small_dir, whole_blocks(), ahead=True, **args)
    _same(ours, ref, rel=1e-4)
    assert engine.passes_planned_ahead >= engine.forward_passes - 2


def test_only_the_picks_a_grammar_keeps_count_for_the_penalties_through_cuda_graphs(small_dir):
    """tests/worker/test_logit_rules.py's check of the constrained drafts, on CUDA."""
    from tests.worker.test_logit_rules import check_only_kept_picks_counted

    engine = Engine(EngineArgs(str(small_dir), device="cuda", dtype="bfloat16", max_running=1))
    check_only_kept_picks_counted(engine, [7, 8, 9] * 21)
