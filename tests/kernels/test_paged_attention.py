"""kernels/paged_attention.py: paged block-causal attention equals dense block-causal attention
on the gathered sequence, over non-contiguous pages and mixed lengths in one batch."""

import torch
from cde.kernels.paged_attention import (
    PagedBatch,
    dense_block_causal_reference,
    gather_pages,
    sdpa_paged_attention,
    write_kv,
)

H, KVH, D, P = 8, 2, 32, 24


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_write_kv_writes_the_right_pages():
    g = torch.Generator().manual_seed(0)
    cache = torch.zeros(KVH, P, 64, D)
    new = torch.randn(3, KVH, 64, D, generator=g)
    pages = torch.tensor([17, 2, 9])
    write_kv(cache, new, pages)
    for i, p in enumerate(pages.tolist()):
        assert torch.equal(cache[:, p], new[i])
    untouched = [p for p in range(P) if p not in pages.tolist()]
    assert cache[:, untouched].abs().sum() == 0
    # overwrite one page, the others keep their content
    newer = torch.randn(1, KVH, 64, D, generator=g)
    write_kv(cache, newer, torch.tensor([2]))
    assert torch.equal(cache[:, 2], newer[0]) and torch.equal(cache[:, 17], new[0])
    # casts into the cache dtype
    bf = torch.zeros(KVH, P, 64, D, dtype=torch.bfloat16)
    write_kv(bf, new, pages)
    assert torch.equal(bf[:, 9], new[2].to(torch.bfloat16))


def test_gather_pages_orders_by_page_table():
    cache = torch.arange(KVH * P * 64 * D, dtype=torch.float32).reshape(KVH, P, 64, D)
    out = gather_pages(cache, torch.tensor([5, 1, 20]))
    assert out.shape == (KVH, 3 * 64, D)
    assert torch.equal(out[:, :64], cache[:, 5]) and torch.equal(out[:, 64:128], cache[:, 1])
    assert torch.equal(out[:, 128:], cache[:, 20])


def test_paged_equals_dense_block_causal_mixed_batch():
    """Three requests of 1, 3 and 5 blocks on scattered pages. One pass holds, per request, every
    block as an item (like a prefill); each item's output must equal the dense block-causal
    attention of that request's whole sequence at that block's rows."""
    g = torch.Generator().manual_seed(1)
    lengths = [1, 3, 5]
    perm = torch.randperm(P, generator=g).tolist()
    req_pages, start = [], 0
    for n in lengths:
        req_pages.append(perm[start : start + n])
        start += n
    assert any(p[1] != p[0] + 1 for p in req_pages if len(p) > 1)  # really non-contiguous
    seqs = [
        (
            torch.randn(1, H, 64 * n, D, generator=g),
            torch.randn(1, KVH, 64 * n, D, generator=g),
            torch.randn(1, KVH, 64 * n, D, generator=g),
        )
        for n in lengths
    ]
    # items in shuffled order: the batch order must not matter
    items = [(r, b) for r, n in enumerate(lengths) for b in range(n)]
    order = torch.randperm(len(items), generator=g).tolist()
    items = [items[i] for i in order]
    q = torch.stack([seqs[r][0][0, :, b * 64 : (b + 1) * 64] for r, b in items])
    k_new = torch.stack([seqs[r][1][0, :, b * 64 : (b + 1) * 64] for r, b in items])
    v_new = torch.stack([seqs[r][2][0, :, b * 64 : (b + 1) * 64] for r, b in items])
    k_cache = torch.full((KVH, P, 64, D), float("nan"))  # unwritten pages must never be read
    v_cache = torch.full((KVH, P, 64, D), float("nan"))
    n_pages = [b + 1 for _, b in items]
    width = max(n_pages)
    batch = PagedBatch(
        write_pages=torch.tensor([req_pages[r][b] for r, b in items]),
        page_table=torch.tensor([req_pages[r][: b + 1] + [0] * (width - b - 1) for r, b in items]),
        n_pages=torch.tensor(n_pages),
        n_pages_host=n_pages,
    )
    write_kv(k_cache, k_new, batch.write_pages)
    write_kv(v_cache, v_new, batch.write_pages)
    out = sdpa_paged_attention(q, (k_cache, v_cache), batch)
    assert out.shape == q.shape and torch.isfinite(out).all()
    for i, (r, b) in enumerate(items):
        dense = dense_block_causal_reference(*seqs[r])
        ref = dense[0, :, b * 64 : (b + 1) * 64]
        assert rel_err(out[i], ref) < 1e-5, (r, b)


def test_item_result_independent_of_batch():
    g = torch.Generator().manual_seed(2)
    k_cache = torch.randn(KVH, P, 64, D, generator=g)
    v_cache = torch.randn(KVH, P, 64, D, generator=g)
    q = torch.randn(3, H, 64, D, generator=g)
    table = torch.tensor([[4, 7, 0], [3, 0, 0], [9, 11, 2]])
    full = sdpa_paged_attention(
        q, (k_cache, v_cache), PagedBatch(table[:, 0], table, torch.tensor([2, 1, 3]), [2, 1, 3])
    )
    alone = sdpa_paged_attention(q[2:], (k_cache, v_cache), PagedBatch(table[2:, 0], table[2:], torch.tensor([3]), [3]))
    assert torch.equal(full[2], alone[0])


def test_dense_reference_is_block_causal():
    """The oracle itself: a query sees exactly the keys of its own and earlier 64-token blocks."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 192, 16, generator=g)
    k = torch.randn(1, 2, 192, 16, generator=g)
    v = torch.randn(1, 2, 192, 16, generator=g)
    out = dense_block_causal_reference(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 128:] += 5.0  # change only the last block's keys/values
    v2[:, :, 128:] -= 5.0
    out2 = dense_block_causal_reference(q, k2, v2)
    assert torch.equal(out[:, :, :128], out2[:, :, :128])  # earlier blocks cannot see block 2
    assert not torch.allclose(out[:, :, 128:], out2[:, :, 128:])
    # inside a block attention is bidirectional: the first row of block 1 sees the block's last key
    k3 = k.clone()
    k3[:, :, 127] += 5.0
    assert not torch.allclose(dense_block_causal_reference(q, k3, v)[:, :, 64], out[:, :, 64])


def test_paged_attention_writes_then_attends():
    """The layer entry point: an item's fresh K/V land in its page before it attends, so a
    prefill block and the next block's step in one pass see each other in block-causal order."""
    from cde.kernels.paged_attention import paged_attention

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, n, 128, D, generator=g) for n in (H, KVH, KVH))
    k_cache = torch.full((KVH, P, 64, D), float("nan"))
    v_cache = torch.full((KVH, P, 64, D), float("nan"))
    pages = [13, 4]
    meta = PagedBatch(
        write_pages=torch.tensor(pages),
        page_table=torch.tensor([[13, 0], [13, 4]]),
        n_pages=torch.tensor([1, 2]),
        n_pages_host=[1, 2],
    )
    split = lambda t: torch.stack([t[0, :, :64], t[0, :, 64:]])
    out = paged_attention(split(q), split(k), split(v), (k_cache, v_cache), meta)
    ref = dense_block_causal_reference(q, k, v)
    assert rel_err(out[0], ref[0, :, :64]) < 1e-5 and rel_err(out[1], ref[0, :, 64:]) < 1e-5
    assert torch.equal(k_cache[:, 4], k[0, :, 64:]) and torch.equal(v_cache[:, 13], v[0, :, :64])
