"""`python -m cde.train --out DIR --minutes M --seed S [--resume]`: train the reference model.

Writes DIR/log.jsonl (losses, rows/s, held-out accuracy), DIR/state.pt (resume point),
DIR/model/ (the CDE checkpoint: config.json, model.safetensors, concept_labels.parquet) and
DIR/model.tar.xz (the archive to ship)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from cde.shared.config import INSTRUCT_VOCAB, ModelConfig
from cde.train.reference_concepts import concepts

# The reference shape: 6 layers x 256 wide (~7M weights with the used embedding rows: 14 MB in
# bf16), 64-token blocks, 512 positions; small enough to ship (and to come back from a device call,
# 16 MiB a file) and to decode on a CPU in seconds.
SHAPES: dict[str, dict] = {
    "reference": dict(
        n_layers=6,
        n_head=4,
        n_kv_heads=2,
        n_embd=256,
        context_len=512,
        n_unknown_concepts=512,
        factorize_rank=32,
        topk_known=16,
        topk_known_features=16,
        unknown_topk=32,
    ),
    # For CPU tests and smoke runs.
    "mini": dict(
        n_layers=2,
        n_head=2,
        n_kv_heads=1,
        n_embd=64,
        context_len=256,
        n_unknown_concepts=64,
        factorize_rank=16,
        topk_known=8,
        topk_known_features=8,
        unknown_topk=8,
    ),
}


def model_config(shape: str) -> ModelConfig:
    return ModelConfig(
        vocab_size=INSTRUCT_VOCAB, instruct=True, n_concepts=len(concepts()), concept_block_size=512, **SHAPES[shape]
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cde.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", choices=sorted(SHAPES), default="reference")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, default=15.0, help="training time, summed over resumes")
    budget.add_argument("--steps", type=int, help="train this many steps instead (exactly reproducible)")
    p.add_argument("--stop-after", type=float, help="end this call after so many wall minutes (resume later)")
    p.add_argument("--stop-step", type=int, help="end this call at this step (resume later)")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true", help="continue from OUT/state.pt")
    start.add_argument("--init-weights", metavar="FILE", help="continue from a weights.pt (fresh optimizer)")
    p.add_argument("--rows", type=int, default=128, help="rows per batch")
    p.add_argument("--length", type=int, default=512, help="tokens per row (a multiple of 64)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200, help="warm-up steps")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto")
    p.add_argument("--compile", action="store_true", help="torch.compile the transformer (CUDA)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader processes building batches")
    p.add_argument("--log-every", type=int, default=50, help="steps")
    p.add_argument("--eval-every", type=float, default=3.0, help="training minutes between held-out evaluations")
    p.add_argument("--eval-problems", type=int, default=32, help="held-out problems per family (0: no evaluation)")
    return p


def main(argv: list[str] | None = None) -> int:
    import torch

    from cde.train.loop import Options, train

    a = parser().parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    if a.length % 64 or a.length > model_config(a.shape).context_len:
        raise SystemExit(f"--length must be a multiple of 64 up to the context ({model_config(a.shape).context_len})")
    fields = {f.name for f in dataclasses.fields(Options)}
    opts = Options(
        config=model_config(a.shape),
        device=device,
        **{k: v for k, v in vars(a).items() if k in fields and k not in ("device",)},
    )
    train(opts, resume=a.resume, weights=a.init_weights)
    return 0


if __name__ == "__main__":
    sys.exit(main())
