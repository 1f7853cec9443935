"""`cde bench engine --flashblock-tau T`: FlashBlock against the exact path, side by side in one
engine. Per concurrency level: the exact run, then one run per `max_reuse`, each reporting
decode tok/s (passes without prefill), attention time per step, token agreement of the greedy generations with the exact
run, and the mean KL(exact || reuse) of the next-token distributions at every reused step.

Attention time per step is the layer's paged attention (FlexAttention, plus split and merge)
replayed as a CUDA graph in isolation at the run's batch size and context, per mode, weighted
by the run's measured mix of refreshed and reused steps, times the number of layers. On CUDA the
exact row also times torch SDPA's flash backend over contiguous KV of the same size per item
(KV heads expanded to the query heads, as flash wants), the same way: what a flash kernel reaches
on the same GPU in the same run (issue 29's bar: exact attention within 1.5x of it).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cde.kernels.flashblock import FlashBlockBatch, external_pages
from cde.kernels.paged_attention import PagedBatch, paged_attention
from cde.shared.config import ATTN_EXACT, ATTN_REFRESH, ATTN_REUSE, PAGE
from cde.shared.protocol import FlashBlockSpec
from cde.worker.cuda_graphs import bucket_mask, bucket_splits
from cde.worker.cuda_timing import graph_replay_ms
from cde.worker.plan import StepPlan

if TYPE_CHECKING:
    from cde.shared.protocol import GenerateRequest
    from cde.worker.engine import Engine
    from cde.worker.model_runner import ModelRunner, Pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--flashblock-tau", type=int, help="also run FlashBlock with this tau (greedy, vs the exact path; default: off)"
    )
    p.add_argument("--flashblock-max-reuse", default="4,16,63", help="comma-separated max_reuse values to run")


class _ModeCount:
    """Counts the attention mode of every step item the engine runs."""

    def __init__(self, engine: Engine) -> None:
        self.counts = {ATTN_EXACT: 0, ATTN_REFRESH: 0, ATTN_REUSE: 0}
        self.runner, self.inner = engine.runner, engine.runner.launch

        def counted(plan: StepPlan, after: Pass | None = None) -> Pass:
            for it in plan.items:
                if it.is_step:
                    self.counts[it.attention] += 1
            return self.inner(plan, after)

        self.runner.launch = counted

    def restore(self) -> dict:
        self.runner.launch = self.inner
        total = sum(self.counts.values()) or 1
        return {m: c / total for m, c in self.counts.items()}


class Deviation:
    """KL(exact || reused) of the next-token distribution at every eligible position of the step
    items that reuse FlashBlock's cache, over every pass the engine runs while it is installed.
    Before such a pass launches, its plan is run once with every item exact and once as
    scheduled (`ModelRunner.step_logits`): two extra forwards per pass, so measure in a run of
    its own, not one that is timed. Both write the same K/V and cache rows the pass then writes."""

    def __init__(self, engine: Engine) -> None:
        self.kl_sum, self.rows = 0.0, 0
        self.runner, self.inner = engine.runner, engine.runner.launch
        self.vocab = engine.cfg.vocab_size

        def measured(plan: StepPlan, after: Pass | None = None) -> Pass:
            # (A pass that reuses is never planned ahead: its items carry no picks for step_logits to miss.)
            if any(it.is_step and it.attention == ATTN_REUSE for it in plan.items):
                self._measure(plan)
            return self.inner(plan, after)

        self.runner.launch = measured

    def _measure(self, plan: StepPlan) -> None:
        exact = StepPlan(tuple(it._replace(attention=ATTN_EXACT) for it in plan.items))
        reference, _ = self.runner.step_logits(exact)
        logits, row_item = self.runner.step_logits(plan)
        reused = [r for r, i in enumerate(row_item) if plan.items[i].attention == ATTN_REUSE]
        idx = torch.tensor(reused, device=logits.device)
        p_log = torch.log_softmax(reference[idx, : self.vocab].float(), -1)
        q_log = torch.log_softmax(logits[idx, : self.vocab].float(), -1)
        self.kl_sum += (p_log.exp() * (p_log - q_log)).sum(-1).sum().item()
        self.rows += len(reused)

    def restore(self) -> float:
        """Uninstall; the mean KL per reused position."""
        self.runner.launch = self.inner
        return self.kl_sum / max(self.rows, 1)


def agreement(exact: dict[str, list[int]], other: dict[str, list[int]]) -> float:
    same = total = 0
    for rid, ref in exact.items():
        out = other[rid]
        same += sum(a == b for a, b in zip(ref, out))
        total += max(len(ref), len(out))
    return same / max(total, 1)


@torch.inference_mode()
def attention_ms(runner: ModelRunner, n: int, ctx_pages: int, mode: int | None) -> float:
    """One layer's paged attention for n items with ctx_pages pages each, all in `mode`
    (None: the unsplit path), in ms."""
    cfg, dev, dtype = runner.cfg, runner.device, runner.dtype
    if runner.forward.flashblock_cache is None:
        runner.forward.allocate_flashblock_cache()
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(n, cfg.n_head, PAGE, cfg.head_dim, generator=g, device=dev, dtype=dtype)
    k, v = (torch.randn(n, cfg.n_kv_heads, PAGE, cfg.head_dim, generator=g, device=dev, dtype=dtype) for _ in "kv")
    cache_pages = runner.forward.kv[0][0].shape[1]
    table = torch.arange(n * ctx_pages, device=dev).view(n, ctx_pages) % (cache_pages - 1)
    n_pages = torch.full((n,), ctx_pages, device=dev)
    split, cache = None, runner.forward.kv[0]
    if mode is not None:
        modes = torch.full((n,), mode, device=dev)
        rows = torch.arange(n, device=dev) % runner.max_running
        split = FlashBlockBatch(
            modes, rows, rows if mode == ATTN_REFRESH else torch.full_like(rows, runner.max_running), [mode] * n
        )
        cache = runner.forward.kv[0] + runner.forward.flashblock_cache[0]
    if dev.type != "cuda":  # the per-item SDPA path, eager
        t0 = time.perf_counter()
        paged_attention(
            q, k, v, cache, PagedBatch(table[:, -1].contiguous(), table, n_pages, [ctx_pages] * n, None, split)
        )
        return (time.perf_counter() - t0) * 1e3
    attend = torch.compile(paged_attention)
    ways = bucket_splits(runner.forward.graphed.kv_splits, n, ctx_pages) if runner.forward.graphed else 1
    mask = bucket_mask(cfg, n, cache_pages, dev, ways)

    def layer() -> torch.Tensor:
        mask.update(table, n_pages if split is None else external_pages(n_pages, split.mode))
        return attend(q, k, v, cache, PagedBatch(table[:, -1].contiguous(), table, n_pages, [], mask, split))

    return graph_replay_ms(layer)[0]


@torch.inference_mode()
def sdpa_ms(
    n: int,
    heads: int,
    head_dim: int,
    ctx_pages: int,
    dtype: torch.dtype,
    backend: SDPBackend = SDPBackend.FLASH_ATTENTION,
) -> float:
    """One layer's attention of n items' 64 queries over ctx_pages * 64 contiguous keys each, KV
    heads expanded to the query heads (as flash wants), by one SDPA backend (CUDA), in ms."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(n, heads, PAGE, head_dim, generator=g, device="cuda", dtype=dtype)
    shape = (n, heads, ctx_pages * PAGE, head_dim)
    k, v = (torch.randn(shape, generator=g, device="cuda", dtype=dtype) for _ in "kv")
    with sdpa_kernel(backend):
        return graph_replay_ms(lambda: F.scaled_dot_product_attention(q, k, v))[0]


def run_level(
    engine: Engine,
    args: argparse.Namespace,
    level: int,
    make_requests: Callable[..., list[GenerateRequest]],
    run: Callable[..., dict],
) -> list[dict]:
    """make_requests(level, tag, flashblock) -> requests; run(engine, requests) -> result dict
    with the generated tokens under "outputs"."""
    ctx_pages = -(-(args.prompt_len + args.max_tokens) // PAGE)
    layers = engine.cfg.n_layers
    exact_ms = attention_ms(engine.runner, level, ctx_pages, None) * layers
    split_ms = {m: attention_ms(engine.runner, level, ctx_pages, m) * layers for m in (ATTN_REFRESH, ATTN_REUSE)}
    exact = run(engine, make_requests(level, f"fbx{level}", False))
    exact.update(flashblock="off", attention_ms_per_step=exact_ms, token_agreement=1.0, mean_kl=0.0)
    if engine.runner.device.type == "cuda":
        cfg = engine.cfg
        flash_ms = sdpa_ms(level, cfg.n_head, cfg.head_dim, ctx_pages, engine.runner.dtype)
        exact["sdpa_flash_ms_per_step"] = flash_ms * layers
    results = [exact]
    for max_reuse in (int(x) for x in args.flashblock_max_reuse.split(",")):
        spec = FlashBlockSpec(args.flashblock_tau, max_reuse)
        run(
            engine, make_requests(level, f"fbw{level}{max_reuse}", spec, prompt_len=PAGE)
        )  # captures this family's graphs
        counter = _ModeCount(engine)
        res = run(engine, make_requests(level, f"fb{level}{max_reuse}", spec))
        mix = counter.restore()
        deviation = Deviation(engine)
        try:
            again = run(engine, make_requests(level, f"fbk{level}{max_reuse}", spec))
        finally:
            mean_kl = deviation.restore()
        res.update(
            flashblock=f"tau={spec.tau},max_reuse={max_reuse}",
            attention_ms_per_step=mix[ATTN_REFRESH] * split_ms[ATTN_REFRESH] + mix[ATTN_REUSE] * split_ms[ATTN_REUSE],
            reused_fraction=mix[ATTN_REUSE],
            token_agreement=agreement(_by_index(exact["outputs"]), _by_index(res["outputs"])),
            mean_kl=mean_kl,
            deterministic=_by_index(again["outputs"]) == _by_index(res["outputs"]),
        )
        results.append(res)
    return results


def _by_index(outputs: dict[str, list[int]]) -> dict[str, list[int]]:
    """Request ids differ per run (tag-i); the i-th requests share a prompt."""
    return {rid.rsplit("-", 1)[1]: toks for rid, toks in outputs.items()}


def decode_ms_per_pass(result: dict) -> float:
    """A decode pass commits one token per request (the FlashBlock runs' one token per step)."""
    return 1e3 * result["concurrency"] / result["decode_tok_per_s"]


def print_table(results: list[dict]) -> None:
    print(
        "conc | context | flashblock | decode tok/s | decode ms/pass | attn ms/step | SDPA flash ms/step | reused"
        " | token agreement | mean KL"
    )
    for r in results:
        flash = r.get("sdpa_flash_ms_per_step")
        flash_text = "—" if flash is None else f"{flash:.2f}"
        print(
            f"{r['concurrency']} | {r['context']} | {r['flashblock']} | {r['decode_tok_per_s']:.1f} | "
            f"{decode_ms_per_pass(r):.2f} | {r['attention_ms_per_step']:.2f} | {flash_text} | "
            f"{r.get('reused_fraction', 0.0):.2f} | {r['token_agreement']:.3f} | {r['mean_kl']:.2e}"
        )
