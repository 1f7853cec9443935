"""The measurement behind kernels/flex_paged_attention.py's KERNEL_OPTIONS (GPU only): one
layer's paged attention on the 8b shape (32 heads, 8 KV heads, head dim 128, bfloat16) per kernel
option set, at batch 1/4/16/32 over 5 and 64 pages, replayed as a CUDA graph. Prints us per layer
and the max relative difference to the engine's options.

Run: PYTHONPATH=. python3 scripts/flex_kernel_options.py
"""

from __future__ import annotations

import itertools

import torch
from torch.nn.attention.flex_attention import flex_attention

from kernels.flex_paged_attention import KERNEL_OPTIONS, PagedBlockMask
from shared.config import PAGE

H, KVH, D, P = 32, 8, 128, 2200
VARIANTS = {
    "engine": KERNEL_OPTIONS,
    "flex's choice": {"BLOCK_M": PAGE, "BLOCK_N": PAGE},  # 64 queries: its split-KV decoding kernel
    "BLOCK_M 32": {**KERNEL_OPTIONS, "BLOCK_M": 32},
    "BLOCK_M 16": {**KERNEL_OPTIONS, "BLOCK_M": 16},
    "BLOCK_M 16, 2 warps": {**KERNEL_OPTIONS, "BLOCK_M": 16, "num_warps": 2},
}


def compiled(options, k, v):
    def attend(q, block_mask):
        n = q.shape[0]
        out = flex_attention(q.transpose(0, 1).reshape(1, H, n * PAGE, D), k, v, block_mask=block_mask,
                             enable_gqa=True, kernel_options=options)
        return out.reshape(H, n, PAGE, D).transpose(0, 1)

    return torch.compile(attend, fullgraph=True)


def time_us(fn, *args) -> tuple[float, torch.Tensor]:
    for _ in range(2):
        fn(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 50 * 1e3, out.float()


def main() -> None:
    torch._dynamo.config.cache_size_limit = 256
    dev = "cuda"
    k, v = (torch.randn(1, KVH, P * PAGE, D, device=dev, dtype=torch.bfloat16) for _ in "kv")
    fns = {name: compiled(opts, k, v) for name, opts in VARIANTS.items()}
    print("batch | pages | " + " | ".join(VARIANTS) + "   (us per layer, max rel. difference to the engine)")
    for n, pages in itertools.product((1, 4, 16, 32), (5, 64)):
        q = torch.randn(n, H, PAGE, D, device=dev, dtype=torch.bfloat16)
        mask = PagedBlockMask(n, P, dev)
        mask.update(torch.randperm(P, device=dev)[: n * pages].view(n, pages), torch.full((n,), pages, device=dev))
        row, ref = [], None
        for fn in fns.values():
            try:
                us, out = time_us(fn, q, mask.block_mask)
            except Exception as ex:  # noqa: BLE001 - an option set the kernel rejects is a table entry
                row.append(f"rejected: {type(ex).__name__}")
                continue
            ref = out if ref is None else ref
            row.append(f"{us:.1f} ({((out - ref).abs().max() / ref.abs().max()).item():.0e})")
        print(f"{n} | {pages} | " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
