"""The decode path never materializes the 101K-wide unknown-concept logits (DESIGN section 1:
go through the rank-r space). Every tensor an operator produces is watched with a
TorchDispatchMode; only the unknown head's own weights may have a 101196/101200 dimension."""

import dataclasses

import pytest
import torch
from cde.kernels.paged_attention import PagedBatch
from cde.shared.config import PAGE, preset
from cde.shared.protocol import GenerateRequest, SteeringSpec
from cde.worker.checkpoint import random_model, save_checkpoint
from cde.worker.engine import Engine, EngineArgs
from cde.worker.last_block import finish
from cde.worker.model import SteerlingModel
from cde.worker.rope import rope_tables
from torch.utils._python_dispatch import TorchDispatchMode

UNKNOWN_DIMS = {101196, 101200}


class ShapeWatch(TorchDispatchMode):
    """Records the shape of every tensor any operator returns."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out

    def unknown_wide(self):
        return [(f, s) for f, s in self.shapes if UNKNOWN_DIMS & set(s)]


def test_watch_sees_unknown_wide_tensors():
    """The detector itself: computing unknown logits the naive way is caught."""
    cfg = preset("8b")
    with torch.device("meta"):
        model = SteerlingModel(dataclasses.replace(cfg, n_layers=1))
        h = torch.zeros(64, cfg.n_embd)
    with ShapeWatch() as w:
        model.unknown_head.predictor_up(model.unknown_head.predictor_down(h))
    assert ("aten.mm.default", (64, 101200)) in w.unknown_wide()


def test_8b_width_forward_and_logits_on_meta():
    """Steerling-8B width, 2 layers, on the meta device: one forward over a batch of items (a
    prefill block and steps of two requests over their pages), the final hidden states of the
    last two items' rows and their token logits."""
    cfg = dataclasses.replace(preset("8b"), n_layers=2)
    n, pages = 3, 8
    with torch.device("meta"):
        model = SteerlingModel(cfg).to(torch.bfloat16)
        tokens = torch.zeros(n, PAGE, dtype=torch.long)
        caches = [
            tuple(torch.zeros(cfg.n_kv_heads, pages, PAGE, cfg.head_dim, dtype=torch.bfloat16) for _ in "kv")
            for _ in range(cfg.n_layers)
        ]
        meta = PagedBatch(
            write_pages=torch.zeros(n, dtype=torch.long),
            page_table=torch.zeros(n, 3, dtype=torch.long),
            n_pages=torch.zeros(n, dtype=torch.long),
            n_pages_host=[1, 2, 3],
        )
        steer = torch.zeros(n, cfg.n_embd, dtype=torch.bfloat16)
        steer_from = torch.zeros(n, dtype=torch.long)
        positions = torch.ones(n, PAGE, dtype=torch.bool)

    with ShapeWatch() as w:
        cos, sin = rope_tables(cfg, 4 * PAGE, device="meta")
        cos, sin = cos[:PAGE][None, None].expand(n, 1, -1, -1), sin[:PAGE][None, None].expand(n, 1, -1, -1)
        out = model(tokens, cos, sin, caches, meta, steer, steer_from, positions)
        hidden = finish(model, out, torch.arange(PAGE, 3 * PAGE, device="meta"))
        logits = model.logits(hidden)
    assert out.x.shape == out.a.shape == (n, PAGE, 4096)
    assert hidden.shape == (2 * PAGE, 4096) and logits.shape == (2 * PAGE, 100281)
    assert len(w.shapes) > 50
    assert w.unknown_wide() == []


@pytest.fixture(scope="module")
def wide_vocab_dir(tmp_path_factory):
    """The 8b vocabulary and concept counts (so 101196 unknown concepts) at a CPU-sized width."""
    cfg = dataclasses.replace(
        preset("8b"),
        n_layers=2,
        n_embd=64,
        n_head=4,
        n_kv_heads=2,
        context_len=512,
        factorize_rank=16,
        intermediate_size=128,
    )
    assert (cfg.n_unknown_concepts, cfg.unknown_padded) == (101196, 101200)
    out = tmp_path_factory.mktemp("wide")
    save_checkpoint(random_model(cfg, seed=0), cfg, out)
    return out


def test_engine_decode_never_builds_unknown_logits(wide_vocab_dir):
    engine = Engine(EngineArgs(str(wide_vocab_dir), max_running=4))
    unknown_weights = {tuple(p.shape) for n, p in engine.runner.model.named_parameters() if "unknown_head" in n}
    assert unknown_weights & {(101200, 16)}
    reqs = [
        GenerateRequest("greedy", list(range(100, 170)), max_tokens=2),
        GenerateRequest(
            "sampled",
            [1, 2, 3],
            max_tokens=2,
            entropy_sampling=True,
            temperature=0.9,
            top_p=0.9,
            top_k=50,
            seed=1,
            repetition_penalty=1.2,
        ),
        GenerateRequest("threshold", [7] * 64, max_tokens=2, confidence_threshold=0.5, tokens_per_step=2),
        GenerateRequest(
            "steered",
            [4, 5],
            max_tokens=2,
            steering=SteeringSpec(concepts=[1, 2], inject_layer=1, relu_logit_mask={3: 1.0}),
        ),
    ]
    with ShapeWatch() as w:
        out = engine.generate(reqs)
    assert all(len(out[r.request_id]) == 2 for r in reqs)
    assert len(w.shapes) > 100
    assert w.unknown_wide() == []
