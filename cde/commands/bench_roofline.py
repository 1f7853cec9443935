"""Roofline table: benchmark results beside the limits of the GPU they ran on and issue 29's
bars, in one table, so that runs of different days compare.

It reads three kinds of JSON: `cde bench engine --json` (a row per level), the same with
`--flashblock-tau` (the long-context stage: a row per level and FlashBlock setting, its decode
passes, its attention beside SDPA flash's over contiguous KV measured in the same run), and
scripts/http_vs_engine.py's summary (a row per level and attribution setting: HTTP tok/s beside
the engine's).

Per result (one concurrency level of one run): ms per pass and tok/s as measured, and the two
limits of a pass: reading every weight matrix once at the copy bandwidth (what one request is
bound by), and the pass's matrix FLOPs at the tensor cores' dense peak (what a batch is bound by).
The roofline is the larger of the two; "of roofline" is how close the pass comes to it. The
weights counted are every linear layer of the checkpoint's shape (the transformer blocks' in FP8
with `--quantization fp8`, the LM head and concept heads in bfloat16 either way); embeddings are
gathered by row, not read whole. FLOPs: 2 per weight per token of the pass's 64-token blocks, and
attention's QK and PV over the run's mean context. "host gap ms" is the time per pass the device
sat idle waiting for the host to launch the next one (`cde bench engine`'s idle share of the run):
time a pass loses that no kernel can win back."""

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
LONG_CONTEXT = 131072  # the long-context bar's 128k tokens (4 layers of the 8b shape), batch 1
LONG_MS_BAR = 3.5  # exact decode, ms per pass
FLASH_RATIO_BAR = 1.5  # exact attention over SDPA flash's on contiguous KV of the same size
HTTP_BAR = 0.03  # HTTP tok/s below the engine's, at most
BANDWIDTH_TB_S = 4.2  # the H200's measured copy bandwidth: the weight-read limit's default


def host_gap_ms(result: dict) -> float:
    """A `cde bench engine` level's ms per pass that the device waited for the host's launch."""
    return result["gpu_idle_fraction"] * result["wall_s"] * 1e3 / result["forward_passes"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="`cde bench engine --json` files")
    p.add_argument("--model", help="checkpoint directory whose config.json gives the shape (default: each run's)")
    p.add_argument(
        "--bandwidth",
        type=float,
        default=BANDWIDTH_TB_S,
        help="device copy bandwidth, TB/s (default: %(default)s, H200 measured)",
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
    ms: float | None  # per pass (decode passes for the long-context rows); None: not measured (HTTP)
    tok_s: float
    read_ms: float | None
    flop_ms: float | None
    gc_share: float | None
    recompiles: int | None
    host_gap_ms: float | None = None  # per pass, the device idle waiting for the host's next launch
    compared: str = ""  # against what else the same run measured (SDPA flash, the engine)
    bar: str = ""
    met: bool | None = None

    @property
    def roofline_ms(self) -> float | None:
        return None if self.read_ms is None or self.flop_ms is None else max(self.read_ms, self.flop_ms)


def limits(s: Shape, quant: str, items: int, context: float, args: argparse.Namespace) -> tuple[float, float]:
    """The weight-read and tensor-core limits of one pass, ms."""
    peak = args.fp8_peak if quant == "fp8" else args.peak
    read = weight_bytes(s, quant) / (args.bandwidth * 1e12) * 1e3
    return read, pass_flops(s, items, context) / (peak * 1e12) * 1e3


def _requests(n: int) -> str:
    return f"{n} request{'s' if n > 1 else ''}"


def _label(quant: str, n: int) -> str:
    return f"{'bf16' if quant == 'none' else quant}, {_requests(n)}"


def engine_rows(report: dict, s: Shape, args: argparse.Namespace) -> list[Row]:
    settings = report["args"]
    prompt = float(str(settings.get("prompt_len", PAGE)).split(",")[0])
    context = prompt + float(settings.get("max_tokens", 0)) / 2
    out = []
    both = {r.get("async_scheduling") for r in report["results"]} == {False, True}  # --compare-async-scheduling
    for r in report["results"]:
        quant, n = r.get("quantization", "none"), int(r["concurrency"])
        ms, tok_s = r["ms_per_forward"], r["output_tok_per_s"]
        read_ms, flop_ms = limits(s, quant, n, context, args)
        gc_share = r.get("gc_ms", 0.0) / (r["wall_s"] * 1e3)
        recompiles = int(r.get("recompiles_after_warmup", 0))
        gap_ms = host_gap_ms(r) if "gpu_idle_fraction" in r else None
        bar, met, label = "", None, _label(quant, n)
        if both and not r["async_scheduling"]:  # the other half of the comparison: no bar
            label += ", planned after the picks"
        elif (quant, n) in BARS:
            max_ms, min_tok_s = BARS[quant, n]
            bar = " and ".join(([f"<= {max_ms:g} ms"] if max_ms is not None else []) + [f">= {min_tok_s:g} tok/s"])
            met = (max_ms is None or ms <= max_ms) and tok_s >= min_tok_s
            met = met and gc_share <= GC_BAR and recompiles == 0
        row = Row(label, ms, tok_s, read_ms, flop_ms, gc_share, recompiles, gap_ms, bar=bar, met=met)
        out.append(row)
    return out


def long_rows(report: dict, s: Shape, args: argparse.Namespace) -> list[Row]:
    """FlashBlock bench rows: decode passes (one token per request each), attention per pass. A
    FlashBlock row has no tensor-core limit: reused attention skips the FLOPs the limit counts."""
    out = []
    max_tokens = float(report["args"].get("max_tokens", 0))
    for r in report["results"]:
        n, context = int(r["concurrency"]), int(r["context"])
        ms = 1e3 * n / r["decode_tok_per_s"]
        read_ms, exact_flop_ms = limits(s, "none", n, context - max_tokens / 2, args)
        flop_ms = exact_flop_ms if r["flashblock"] == "off" else None
        flash = r.get("sdpa_flash_ms_per_step")
        ratio = r["attention_ms_per_step"] / flash if flash else None
        compared = "" if ratio is None else f"attention {ratio:.2f}x SDPA flash"
        bar, met = "", None
        if r["flashblock"] == "off" and n == 1 and context >= LONG_CONTEXT:
            bar = f"<= {LONG_MS_BAR:g} ms and attention <= {FLASH_RATIO_BAR:g}x SDPA flash"
            met = ms <= LONG_MS_BAR and ratio is not None and ratio <= FLASH_RATIO_BAR
        run = f"{s.n_layers} layers, {context // 1024}k, {_requests(n)}, FlashBlock {r['flashblock']}"
        out.append(Row(run, ms, r["decode_tok_per_s"], read_ms, flop_ms, None, None, None, compared, bar, met))
    return out


def http_rows(summary: dict) -> list[Row]:
    out = []
    for c in summary["cells"]:
        gap = c["http_tok_s"] / c["engine_tok_s"] - 1
        run = f"HTTP, {_requests(int(c['concurrency']))}, attribution {'on' if c['attribution'] else 'off'}"
        compared = f"{100 * gap:+.1f}% vs the engine ({c['engine_tok_s']:.1f} tok/s)"
        bar = f"within {100 * HTTP_BAR:g}% of the engine"
        out.append(Row(run, None, c["http_tok_s"], None, None, None, None, None, compared, bar, gap >= -HTTP_BAR))
    return out


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def table(all_rows: list[Row]) -> str:
    lines = [
        "run | ms/pass | tok/s | weight-read limit ms | tensor-core limit ms | of roofline | GC | recompiles"
        " | host gap ms | compared with | issue 29 bar | met",
        "--- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | ---",
    ]
    for r in all_rows:
        share = None if r.ms is None or r.roofline_ms is None else 100 * r.roofline_ms / r.ms
        gc = "—" if r.gc_share is None else f"{100 * r.gc_share:.2f}% (<= {100 * GC_BAR:g}%)"
        lines.append(
            f"{r.run} | {_num(r.ms, '.2f')} | {r.tok_s:.1f} | {_num(r.read_ms, '.2f')} | {_num(r.flop_ms, '.2f')} | "
            f"{_num(share, '.0f')}{'%' if share is not None else ''} | {gc} | {_num(r.recompiles, 'd')} | "
            f"{_num(r.host_gap_ms, '.2f')} | "
            f"{r.compared or '—'} | {r.bar or '—'} | {'—' if r.met is None else 'yes' if r.met else 'no'}"
        )
    return "\n".join(lines)


def report_shape(report: dict, path: str, args: argparse.Namespace) -> Shape:
    """The checkpoint's shape: --model's, else the config the run recorded, else its --model's."""
    if args.model:
        return shape(ModelConfig.from_json(Path(args.model) / "config.json"))
    if "config" in report:
        return shape(ModelConfig.from_dict(report["config"]))
    model = report["args"].get("model")
    if not model:
        raise SystemExit(f"cde bench roofline: {path} names no checkpoint; give --model")
    return shape(ModelConfig.from_json(Path(model) / "config.json"))


def run(args: argparse.Namespace) -> int:
    all_rows: list[Row] = []
    for path in args.results:
        report = json.loads(Path(path).read_text())
        if "cells" in report:  # scripts/http_vs_engine.py
            all_rows += http_rows(report)
            continue
        s = report_shape(report, path, args)
        is_long = any("flashblock" in r for r in report["results"])
        all_rows += long_rows(report, s, args) if is_long else engine_rows(report, s, args)
    print(table(all_rows))
    return 0
