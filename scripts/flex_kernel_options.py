"""The measurement behind kernels/flex_paged_attention.py's layouts and the split-KV choice
(GPU only): one layer's paged attention on the 8b shape (32 heads, 4 KV heads, head dim 128,
bfloat16) per variant, at several batch sizes and page counts, replayed as a CUDA graph, beside
torch SDPA's flash and cuDNN backends over contiguous KV of the same size (expanded to 32 heads).
Prints us per layer and the max relative difference to the first variant.

Run: PYTHONPATH=. python3 scripts/flex_kernel_options.py [BATCHxPAGES ...] [--variants SUBSTRING,...]
"""

from __future__ import annotations

import sys

import torch
from cde.kernels.flex_paged_attention import KERNEL_OPTIONS, PagedBlockMask, flex_paged_attention
from cde.shared.config import PAGE
from cde.worker.cuda_timing import graph_replay_ms
from torch.nn.attention import SDPBackend

from cde.commands.bench_flashblock import sdpa_ms

H, KVH, D = 32, 4, 128
CASES = [(1, 5), (1, 64), (1, 256), (1, 1024), (1, 2048), (4, 64), (4, 1024), (8, 2048), (16, 64), (32, 64)]
P = 8 * 2048 + 1  # cache pages: the largest case's
PACKED_128_W4 = {**KERNEL_OPTIONS, "BLOCK_M": 2 * PAGE, "num_warps": 4}
# name -> (query heads packed per KV head: the 8b's 8, or 1; kernel options, None: PagedBlockMask's
# default for the layout, as the engine builds it; the split-KV ways timed). The first variant, per
# head unsplit, is the reference of the difference column (the engine's layout before 2026-12-02).
LAYOUTS = {
    "per head": (1, None, (1, 4, 8)),
    "engine (packed)": (8, None, (1, 2, 4, 8, 16)),
    "packed 64-row": (8, KERNEL_OPTIONS, (1, 4)),
    "packed 128-row w4": (8, PACKED_128_W4, (8,)),
}
VARIANTS = {
    f"{name}, split {s}": (group, s, options) for name, (group, options, splits) in LAYOUTS.items() for s in splits
}


def sdpa_cell(backend: SDPBackend, n: int, pages: int) -> str:
    """SDPA over contiguous KV of the same length (long contexts only)."""
    if pages < 1024:
        return "-"
    try:
        return f"{sdpa_ms(n, H, D, pages, torch.bfloat16, backend) * 1e3:.1f}"
    except Exception as ex:  # a backend that refuses the shape
        return f"rejected: {type(ex).__name__}"


def main() -> None:
    torch._dynamo.config.cache_size_limit = 512
    dev = "cuda"
    args = sys.argv[1:]
    pick = args[args.index("--variants") + 1].split(",") if "--variants" in args else None
    cases = [tuple(map(int, a.split("x"))) for a in args if "x" in a and a[0].isdigit()] or CASES
    variants = {k: v for k, v in VARIANTS.items() if pick is None or any(p in k for p in pick)}
    k_cache, v_cache = (torch.randn(KVH, P, PAGE, D, device=dev, dtype=torch.bfloat16) for _ in "kv")
    attend = torch.compile(flex_paged_attention, dynamic=False)  # a layout's grouping must stay static
    names = list(variants) + ["SDPA flash (contiguous)", "SDPA cuDNN (contiguous)"]
    print("| batch | pages | " + " | ".join(names) + " |   (us per layer, max rel. difference to the first)")
    print("|" + " --- |" * (len(names) + 2))
    for n, pages in cases:
        q = torch.randn(n, H, PAGE, D, device=dev, dtype=torch.bfloat16)
        table = torch.randperm(P, device=dev)[: n * pages].view(n, pages)
        lengths = torch.full((n,), pages, device=dev)
        row, ref = [], None
        for group, splits, options in variants.values():
            if n * splits > 64:
                row.append("-")
                continue
            mask = PagedBlockMask(n, P, dev, splits, group, options)
            mask.update(table, lengths)
            try:
                ms, out = graph_replay_ms(lambda q=q, mask=mask: attend(q, k_cache, v_cache, mask), iters=20)
            except Exception as ex:
                row.append(f"rejected: {type(ex).__name__}")
                continue
            out = out.float()
            ref = out if ref is None else ref
            row.append(f"{ms * 1e3:.1f} ({((out - ref).abs().max() / ref.abs().max()).item():.0e})")
        row += [sdpa_cell(b, n, pages) for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION)]
        print(f"| {n} | {pages} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
