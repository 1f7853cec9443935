"""GPU tests (run on the H200 through scripts/gpu_run.sh): the FlexAttention paged kernel against
a dense reference, float32 parity with the official generator through the CUDA-graph path, and
zero recompiles once warm while steering/attribution toggle per request."""

import pytest
import torch

from kernels.flex_paged_attention import PagedBlockMask, flex_paged_attention
from kernels.paged_attention import dense_block_causal_reference
from shared.protocol import AttributionSpec, GenerateRequest, SteeringSpec
from worker.engine import Engine, EngineArgs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_flex_paged_attention_matches_dense(dtype, tol):
    torch.manual_seed(0)
    kvh, h, d, cache_pages = 4, 32, 128, 40
    lengths = [1, 3, 7, 2]  # blocks per request: mixed lengths in one batch
    perm = torch.randperm(cache_pages).tolist()  # non-contiguous pages
    seqs, off = [], 0
    for n in lengths:
        seqs.append(perm[off: off + n])
        off += n
    k_cache = torch.randn(kvh, cache_pages, 64, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(len(seqs), h, 64, d, device="cuda", dtype=dtype)  # the last block of each request
    table = torch.zeros(len(seqs), max(lengths), dtype=torch.long, device="cuda")
    for i, p in enumerate(seqs):
        table[i, : len(p)] = torch.tensor(p)
    mask = PagedBlockMask(len(seqs), cache_pages, "cuda")
    mask.update(table, torch.tensor(lengths, device="cuda"))
    out = torch.compile(flex_paged_attention)(q, k_cache, v_cache, mask.block_mask)
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
    engine = Engine(EngineArgs(str(small_dir), device="cuda", dtype="float32"))
    g = torch.Generator().manual_seed(5)
    for n in (64, 128, 192):
        prompt = torch.randint(0, 100000, (n,), generator=g).tolist()
        ref = gen.generate_full(torch.tensor([prompt]), GenerationConfig(
            max_new_tokens=128, steps=128, temperature=0, use_entropy_sampling=False, top_p=0, repetition_penalty=1))
        ours = engine.generate([GenerateRequest(f"p{n}", prompt, max_tokens=128)])[f"p{n}"]
        assert ours == ref.tokens[n:].tolist()


def test_no_recompiles_after_warmup_while_features_toggle(small_dir):
    from torch._dynamo.utils import counters

    engine = Engine(EngineArgs(str(small_dir), device="cuda", dtype="bfloat16", max_running=8))

    def wave(tag):
        reqs = [GenerateRequest(f"{tag}{i}", [7 + i] * 64, max_tokens=64,
                                steering=SteeringSpec(concepts=[i], inject_layer=1 + i % 3) if i % 2 else None,
                                attribution=AttributionSpec() if i % 3 == 0 else None) for i in range(8)]
        engine.generate(reqs)

    for n in (1, 2, 4, 8):  # warm every bucket the waves use
        engine.generate([GenerateRequest(f"w{n}-{i}", [3] * 64, max_tokens=64) for i in range(n)])
    wave("a")
    before = dict(counters["stats"])
    wave("b")
    wave("c")
    assert dict(counters["stats"]) == before
