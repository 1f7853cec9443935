"""worker/last_block.py: a pass stops after the last block's attention and `finish` computes the
final hidden states of some rows only. They must be the rows of the whole computation (every block
over every row, then the final norm), in the rows' order: pre- and post-norm, FP8, a row count that
is not a multiple of 64 (padded inside) and one that is more than 64, with steering from the last
layer on for one item and off (a non-zero vector, gated out) for another."""

import dataclasses

import pytest
import torch
from cde.kernels.paged_attention import PagedBatch
from cde.shared.config import MASK_ID, PAGE, preset
from cde.worker import fp8
from cde.worker.checkpoint import random_model
from cde.worker.last_block import TAIL_VARIANTS, TailInputs, finish, tail_rows, whole_pages
from cde.worker.model import HandedOn, SteerlingModel
from cde.worker.rope import rope_tables
from cde.worker.stream_linear import StreamLinear, install
from torch._dynamo.testing import CompileCounter

BLOCKS = [0, 0, 1]  # per item: its block; item 2 attends to item 0's page too
PAGES = [[0], [1], [0, 2]]


def pass_inputs(model: SteerlingModel, seed: int) -> tuple:
    """A pass of three items (a prefill, two steps with random masked positions) over a fresh
    cache: item 1 steers from the last layer on, item 2 has a vector whose layer is past the last."""
    cfg = model.cfg
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    n = len(PAGES)
    tokens = torch.randint(0, 100000, (n, PAGE), generator=gen)
    masked = torch.rand(n, PAGE, generator=gen) < 0.5
    masked[0] = False
    tokens[masked] = MASK_ID
    caches = [
        tuple(torch.zeros(cfg.n_kv_heads, 3, PAGE, cfg.head_dim, dtype=dtype) for _ in "kv")
        for _ in range(cfg.n_layers)
    ]
    meta = PagedBatch(
        write_pages=torch.tensor([p[-1] for p in PAGES]),
        page_table=torch.tensor([[*p, *[0] * (2 - len(p))] for p in PAGES]),
        n_pages=torch.tensor([len(p) for p in PAGES]),
        n_pages_host=[len(p) for p in PAGES],
    )
    cos, sin = rope_tables(cfg, 2 * PAGE)
    pos = torch.tensor(BLOCKS)[:, None] * PAGE + torch.arange(PAGE)
    steer_vec = torch.randn(n, cfg.n_embd, generator=gen).to(dtype)
    steer_vec[0] = 0
    steer_from = torch.tensor([cfg.n_layers + 1, cfg.n_layers, cfg.n_layers + 1])
    return tokens, cos[pos][:, None], sin[pos][:, None], caches, meta, steer_vec, steer_from, masked


def whole_pass(model: SteerlingModel, tokens, cos, sin, caches, meta, steer_vec, steer_from, masked) -> torch.Tensor:
    """Every block over every row, then the final norm: the final hidden states [N * 64, D]."""
    x = model.transformer.tok_emb(tokens)
    inject = steer_vec[:, None, :] * masked[:, :, None].to(steer_vec.dtype)
    handed: HandedOn = None
    for i, block in enumerate(model.transformer.blocks):
        x, handed = block(x, cos, sin, caches[i], meta, inject, (steer_from <= i + 1).to(x.dtype), handed)
    return model.transformer.ln_f(x).reshape(-1, model.cfg.n_embd)


def fresh(caches: list) -> list:
    return [tuple(t.clone() for t in layer) for layer in caches]


def tiny_model(norm_order: str, quantization: str) -> SteerlingModel:
    cfg = dataclasses.replace(preset("tiny"), norm_order=norm_order)
    dtype = torch.bfloat16 if quantization == "fp8" else torch.float32
    model = random_model(cfg, seed=3, dtype=dtype)
    return fp8.quantize_model(model) if quantization == "fp8" else model


@pytest.mark.parametrize(
    "norm_order,quantization", [("post", "none"), ("pre", "none"), ("post", "fp8")], ids=["post", "pre", "fp8"]
)
def test_finish_gives_the_rows_of_the_whole_computation(norm_order, quantization):
    model = tiny_model(norm_order, quantization)
    tokens, cos, sin, caches, meta, steer_vec, steer_from, masked = pass_inputs(model, seed=1)
    want_kv, kv = fresh(caches), fresh(caches)
    with torch.inference_mode():
        want = whole_pass(model, tokens, cos, sin, want_kv, meta, steer_vec, steer_from, masked)
        out = model(tokens, cos, sin, kv, meta, steer_vec, steer_from, masked)
        steered = torch.nonzero(masked[1]).flatten() + PAGE  # item 1's masked rows, which steer
        gated_out = torch.nonzero(masked[2]).flatten() + 2 * PAGE
        gen = torch.Generator().manual_seed(2)
        for rows in (
            torch.cat((steered[:20], gated_out[:17])).flip(0),  # 37 rows, in no particular order
            torch.randperm(3 * PAGE, generator=gen)[:100],  # more than one page of rows, any of them
        ):
            assert rows.numel() % PAGE, "the test wants a row count that must be padded"
            got = finish(model, out, rows)
            assert got.shape == (rows.numel(), model.cfg.n_embd)
            assert torch.allclose(got.float(), want[rows].float(), rtol=0, atol=1e-6), (got - want[rows]).abs().max()
    # Every layer's K/V written as the whole computation wrote them, the last one's by its head.
    for ours, theirs in zip(kv, want_kv):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert steer_vec[1].abs().sum() > 0 and masked[1].any() and masked[2].any()  # nothing vacuous


def test_no_rows_run_nothing():
    model = tiny_model("post", "none")
    with torch.inference_mode():
        out = model(*pass_inputs(model, seed=1))
        assert finish(model, out, torch.empty(0, dtype=torch.long)).shape == (0, model.cfg.n_embd)


def test_rows_are_padded_to_whole_pages_with_a_row_of_their_own():
    rows = torch.arange(70)
    padded = whole_pages(rows)
    assert padded.numel() == 2 * PAGE and torch.equal(padded[:70], rows) and set(padded[70:].tolist()) == {69}
    assert torch.equal(whole_pages(torch.arange(PAGE)), torch.arange(PAGE))


def test_the_compiled_tails_variants_cover_every_pass():
    """The CUDA path compiles `tail_rows` and, at startup, runs TAIL_VARIANTS: after them no pass's
    shapes (1 to 64 items, any number of pages of rows up to theirs) may compile again, or a request
    would wait for a compile. Dynamo's guards are the same on the CPU; the StreamLinears are set to
    their 64-row path, so their row-count guard is there too."""
    model = tiny_model("post", "none")
    install(model, time_ms=lambda *race: 1.0)
    for m in model.modules():
        if isinstance(m, StreamLinear):
            m.stream = True
    counter = CompileCounter()
    run = torch.compile(tail_rows, backend=counter)
    torch._dynamo.reset()

    def tail(items: int, pages: int) -> None:
        d = model.cfg.n_embd
        out = TailInputs(*(torch.randn(items, PAGE, d) for _ in "xai"), torch.ones(items, PAGE))
        finish(model, out, torch.arange(pages * PAGE), run)

    with torch.inference_mode():
        for items, pages in TAIL_VARIANTS:
            tail(items, pages)
        assert counter.frame_count == len(TAIL_VARIANTS)
        for items, pages in ((1, 1), (2, 1), (2, 2), (3, 1), (8, 5), (32, 16), (32, 32), (64, 1), (64, 64), (24, 3)):
            tail(items, pages)
    assert counter.frame_count == len(TAIL_VARIANTS)
