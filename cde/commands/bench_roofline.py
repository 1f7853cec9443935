"""Roofline table: `cde bench engine --json` results beside the limits of the GPU they ran on, so
that runs of different days compare (issue 29).

Per result (one concurrency level of one run): ms per pass and tok/s as measured, and the two
limits of a pass: reading every weight matrix once at the copy bandwidth (what one request is
bound by), and the pass's matrix FLOPs at the tensor cores' dense peak (what a batch is bound by).
The roofline is the larger of the two; "of roofline" is how close the pass comes to it. The
weights counted are every linear layer of the checkpoint's shape (the transformer blocks' in FP8
with `--quantization fp8`, the LM head and concept heads in bfloat16 either way); embeddings are
gathered by row, not read whole. FLOPs: 2 per weight per token of the pass's 64-token blocks, and
attention's QK and PV over the run's mean context."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from cde.shared.config import PAGE, ModelConfig

# Issue 29's bars per (quantization, concurrency): ms per pass at most, tok/s at least.
BARS: dict[tuple[str, int], tuple[float | None, float]] = {
    ("none", 1): (4.8, 205.0),
    ("fp8", 1): (3.2, 300.0),
    ("none", 32): (None, 650.0),
    ("fp8", 32): (None, 1000.0),
}
GC_BAR = 0.01  # share of the run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="`cde bench engine --json` files")
    p.add_argument("--model", help="checkpoint directory whose config.json gives the shape (default: each run's)")
    p.add_argument(
        "--bandwidth", type=float, default=4.2, help="device copy bandwidth, TB/s (default: %(default)s, H200 measured)"
    )
    p.add_argument(
        "--peak", type=float, default=790.0, help="bfloat16 dense peak, TFLOP/s (default: %(default)s, H200)"
    )
    p.add_argument("--fp8-peak", type=float, default=1580.0, help="FP8 dense peak, TFLOP/s (default: %(default)s)")


@dataclass(frozen=True)
class Shape:
    block_linear: int  # weights of the transformer blocks' linear layers (the ones FP8 quantizes)
    other_linear: int  # LM head and the concept heads' linear layers
    n_layers: int
    n_embd: int


def shape(cfg: ModelConfig) -> Shape:
    """Counts the weights of the real module tree, built on the meta device (no memory)."""
    import torch

    from cde.worker.model import SteerlingModel

    with torch.device("meta"):
        model = SteerlingModel(cfg)
    block = other = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            if name.startswith("transformer.blocks."):
                block += module.weight.numel()
            else:
                other += module.weight.numel()
    return Shape(block, other, cfg.n_layers, cfg.n_embd)


def weight_bytes(s: Shape, quantization: str) -> float:
    return s.block_linear * (1 if quantization == "fp8" else 2) + s.other_linear * 2


def pass_flops(s: Shape, items: int, context: float) -> float:
    tokens = items * PAGE
    return 2.0 * (s.block_linear + s.other_linear) * tokens + 4.0 * s.n_layers * tokens * context * s.n_embd


@dataclass(frozen=True)
class Row:
    run: str
    ms: float
    tok_s: float
    read_ms: float
    flop_ms: float
    gc_share: float
    recompiles: int
    bar: str

    @property
    def roofline_ms(self) -> float:
        return max(self.read_ms, self.flop_ms)


def rows(report: dict, s: Shape, args: argparse.Namespace) -> list[Row]:
    settings = report["args"]
    prompt = float(str(settings.get("prompt_len", PAGE)).split(",")[0])
    context = prompt + float(settings.get("max_tokens", 0)) / 2
    out = []
    for r in report["results"]:
        quant, n = r.get("quantization", "none"), int(r["concurrency"])
        peak = args.fp8_peak if quant == "fp8" else args.peak
        out.append(
            Row(
                run=f"{'bf16' if quant == 'none' else quant}, {n} request{'s' if n > 1 else ''}",
                ms=r["ms_per_forward"],
                tok_s=r["output_tok_per_s"],
                read_ms=weight_bytes(s, quant) / (args.bandwidth * 1e12) * 1e3,
                flop_ms=pass_flops(s, n, context) / (peak * 1e12) * 1e3,
                gc_share=r.get("gc_ms", 0.0) / (r["wall_s"] * 1e3),
                recompiles=int(r.get("recompiles_after_warmup", 0)),
                bar=_bar(quant, n),
            )
        )
    return out


def _bar(quantization: str, concurrency: int) -> str:
    if (quantization, concurrency) not in BARS:
        return ""
    ms, tok_s = BARS[quantization, concurrency]
    return " and ".join(([f"<= {ms:g} ms"] if ms is not None else []) + [f">= {tok_s:g} tok/s"])


def table(all_rows: list[Row]) -> str:
    lines = [
        "run | ms/pass | tok/s | weight-read limit ms | tensor-core limit ms | of roofline | GC | recompiles"
        " | issue 29 bar",
        "--- | --- | --- | --- | --- | --- | --- | --- | ---",
    ]
    for r in all_rows:
        lines.append(
            f"{r.run} | {r.ms:.2f} | {r.tok_s:.1f} | {r.read_ms:.2f} | {r.flop_ms:.2f} | "
            f"{100 * r.roofline_ms / r.ms:.0f}% | {100 * r.gc_share:.2f}% (<= {100 * GC_BAR:g}%) | {r.recompiles} | "
            f"{r.bar or '—'}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    all_rows: list[Row] = []
    for path in args.results:
        report = json.loads(Path(path).read_text())
        model = args.model or report["args"].get("model")
        if not model:
            raise SystemExit(f"cde bench roofline: {path} names no checkpoint; give --model")
        all_rows += rows(report, shape(ModelConfig.from_json(Path(model) / "config.json")), args)
    print(table(all_rows))
    return 0
