"""The measurement behind kernels/flex_paged_attention.py's kernel options and `--kv-splits`
(GPU only): one layer's paged attention on the 8b shape (32 heads, 8 KV heads, head dim 128,
bfloat16) per variant, at several batch sizes and page counts, replayed as a CUDA graph. Prints
us per layer and the max relative difference to the first variant.

Run: PYTHONPATH=. python3 scripts/flex_kernel_options.py
"""

from __future__ import annotations

import torch
from cde.kernels.flex_paged_attention import KERNEL_OPTIONS, SINGLE_TILE_OPTIONS, PagedBlockMask, flex_paged_attention
from cde.shared.config import PAGE
from torch.nn.attention.flex_attention import flex_attention

from cde.commands.bench_flashblock import graph_replay_ms

H, KVH, D = 32, 8, 128
CASES = [(1, 5), (1, 64), (1, 256), (1, 1024), (4, 64), (4, 1024), (16, 64), (32, 64)]  # (batch, pages)
P = max(n * pages for n, pages in CASES) + 1
OPTIONS = {  # kernel options, unsplit
    "64-row tiles (engine, batch >= 2)": KERNEL_OPTIONS,
    "flex's choice": {"BLOCK_M": PAGE, "BLOCK_N": PAGE},  # 64 queries: its split-KV decoding kernel
    "16-row tiles, 2 warps (engine, batch 1)": SINGLE_TILE_OPTIONS,
}
SPLITS = (2, 4, 8)  # the engine's attention with --kv-splits S at this batch


def with_options(options, k, v):
    def attend(q, block_mask):
        n = q.shape[0]
        out = flex_attention(
            q.transpose(0, 1).reshape(1, H, n * PAGE, D),
            k,
            v,
            block_mask=block_mask,
            enable_gqa=True,
            kernel_options=options,
        )
        return out.reshape(H, n, PAGE, D).transpose(0, 1)

    return torch.compile(attend, fullgraph=True)


def main() -> None:
    torch._dynamo.config.cache_size_limit = 256
    dev = "cuda"
    k_cache, v_cache = (torch.randn(KVH, P, PAGE, D, device=dev, dtype=torch.bfloat16) for _ in "kv")
    k, v = (c.view(1, KVH, P * PAGE, D) for c in (k_cache, v_cache))
    fns = {name: with_options(opts, k, v) for name, opts in OPTIONS.items()}
    split_fn = torch.compile(flex_paged_attention)
    names = list(OPTIONS) + [f"kv-splits {s}" for s in SPLITS]
    print("batch | pages | " + " | ".join(names) + "   (us per layer, max rel. difference to the first)")
    for n, pages in CASES:
        q = torch.randn(n, H, PAGE, D, device=dev, dtype=torch.bfloat16)
        table = torch.randperm(P, device=dev)[: n * pages].view(n, pages)
        lengths = torch.full((n,), pages, device=dev)
        masks = {}
        for s in (1, *SPLITS):
            masks[s] = PagedBlockMask(n, P, dev, s)
            masks[s].update(table, lengths)
        runs = [(fn, masks[1]) for fn in fns.values()]
        runs += [(lambda q, m: split_fn(q, k_cache, v_cache, m), masks[s]) for s in SPLITS]
        row, ref = [], None
        for fn, mask in runs:
            try:
                ms, out = graph_replay_ms(lambda fn=fn, q=q, mask=mask: fn(q, mask.block_mask), iters=50)
            except Exception as ex:
                row.append(f"rejected: {type(ex).__name__}")
                continue
            out = out.float()
            ref = out if ref is None else ref
            row.append(f"{ms * 1e3:.1f} ({((out - ref).abs().max() / ref.abs().max()).item():.0e})")
        print(f"{n} | {pages} | " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
