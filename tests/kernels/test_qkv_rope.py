"""kernels/qkv_rope.py on the CPU, its Triton kernel in Triton's interpreter (tests/conftest.py):
against the model's own torch path (`Attention.qkv`, then `write_kv`), which the parity tests hold
to the official package; and under torch.compile, where the caches must stay mutated in place.
The interpreter decodes bfloat16 loads wrongly, so these run in float16 (the kernel computes in
float32 and rounds to the tensors' dtype either way); test_gpu.py runs the engine on it in bfloat16."""

import dataclasses
import os
import re

import pytest
import torch
from cde.kernels.paged_attention import write_kv
from cde.kernels.qkv_rope import fused_input_stage, qkv_rope_write, tileable_head
from cde.shared.config import PAGE, ModelConfig
from cde.worker.model import Attention
from cde.worker.rope import rope_tables

assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()

CFG = ModelConfig(n_layers=1, n_head=4, n_kv_heads=2, n_embd=64, context_len=8 * PAGE)  # head_dim 16
CACHE_PAGES = 6
WRITE_PAGES = torch.tensor([4, 0, 2])  # three items, out of order, pages 1, 3 and 5 untouched
BLOCKS = torch.tensor([2, 0, 5])  # the items' block indices: their RoPE positions


def setup(cfg: ModelConfig, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    attn = Attention(cfg)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() == 2 else 1.0))
    attn = attn.half()
    n = len(WRITE_PAGES)
    # Large enough that clip_qkv (10) cuts some entries, with a few rows near zero for the norm.
    x = (torch.randn(n, PAGE, cfg.n_embd, generator=g) * 2).half()
    x[1, :3] *= 1e-3
    cos, sin = rope_tables(cfg, cfg.context_len)
    pos = BLOCKS[:, None] * PAGE + torch.arange(PAGE)
    cache = [torch.randn(cfg.n_kv_heads, CACHE_PAGES, PAGE, cfg.head_dim, generator=g).half() for _ in "kv"]
    return attn, x, cos[pos][:, None], sin[pos][:, None], cache


def fused(attn: Attention, x, cos, sin, cache, group: int) -> torch.Tensor:
    cfg = attn.cfg
    norm = cfg.use_qk_norm
    with torch.no_grad():
        return qkv_rope_write(
            attn.c_attn(x),
            attn.q_norm.weight if norm else None,
            attn.k_norm.weight if norm else None,
            cos[:, 0],
            sin[:, 0],
            cache[0],
            cache[1],
            WRITE_PAGES,
            cfg.clip_qkv,
            cfg.norm_eps,
            cfg.n_head,
            group,
        )


@pytest.mark.parametrize(
    "changes",
    [{}, {"clip_qkv": None}, {"use_qk_norm": False}, {"clip_qkv": 0.5}],
    ids=["8b-like", "no-clip", "no-qk-norm", "tight-clip"],
)
@pytest.mark.parametrize("group", [1, 2])  # 2: both query heads of a KV head in one packed head
def test_the_kernel_is_the_model_path_with_q_packed_and_k_v_in_their_pages(changes, group):
    cfg = dataclasses.replace(CFG, **changes)
    attn, x, cos, sin, cache = setup(cfg)
    expected_cache = [c.clone() for c in cache]
    with torch.no_grad():
        q, k, v = attn.qkv(x, cos, sin)
    write_kv(expected_cache[0], k, WRITE_PAGES)
    write_kv(expected_cache[1], v, WRITE_PAGES)
    n, h, t, d = q.shape
    expected_q = q.view(n, h // group, group, t, d).transpose(0, 1)

    out = fused(attn, x, cos, sin, cache, group)

    assert out.shape == (h // group, n, group, t, d) and out.is_contiguous()
    # One float16 rounding apart at most (the same float32 math, summed in another order).
    torch.testing.assert_close(out, expected_q, rtol=2e-3, atol=2e-3)
    for got, want in zip(cache, expected_cache):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        assert torch.equal(got[:, [1, 3, 5]], want[:, [1, 3, 5]])  # pages no item writes: untouched


def test_compiled_the_caches_are_written_in_place_without_a_copy():
    """The compiled blocks pass the layer's caches in; a functionalized mutation could copy a
    whole cache per layer and pass. Inductor's output code must allocate nothing cache-sized."""
    from torch._inductor.utils import run_and_get_code

    attn, x, cos, sin, cache = setup(CFG, seed=1)
    eager_cache = [c.clone() for c in cache]
    eager_q = fused(attn, x, cos, sin, eager_cache, 2)

    def layer(x, cos, sin, k_cache, v_cache):
        return fused(attn, x, cos, sin, (k_cache, v_cache), 2) * 2

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    out, codes = run_and_get_code(compiled, x, cos, sin, cache[0], cache[1])
    torch._dynamo.reset()
    assert torch.equal(out, eager_q * 2)
    assert all(torch.equal(c, e) for c, e in zip(cache, eager_cache))  # visible to the caller
    shape = ", ".join(str(s) for s in cache[0].shape)
    allocations = re.findall(r"empty_strided\w*\(\(([\d, ]+)\)", "\n".join(codes))
    assert allocations and shape not in allocations, allocations
    assert "copy_" not in "\n".join(codes)


def test_the_kernel_takes_heads_whose_halves_are_a_power_of_two():
    assert [d for d in range(1, 260) if tileable_head(d)] == [2, 4, 8, 16, 32, 64, 128, 256]
    assert not fused_input_stage(torch.zeros(1, device="meta"), 128)  # CUDA only
