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
time a pass loses that no kernel can win back.

The limits are the card's the run recorded (`device` in the JSON; reports written before that field
were all the H200's): its measured copy bandwidth and dense bfloat16 rate, FP8's twice that. Issue
29's bars were set on the H200: a row from another card shows its bar but does not judge it, so a
table from an H100 never reads as a bar met or missed."""

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


@dataclass(frozen=True)
class Card:
    bandwidth: float | None  # TB/s, a device-to-device copy counting bytes read and written
    peak: float | None  # dense bfloat16 TFLOP/s (an 8192^3 product on random data)
    fp8_peak: float | None


# Measured on the lent machines (the device tool's KINDS.md; the H200's copy also in docs/benchmarks.md).
CARDS = {
    "NVIDIA H200": Card(4.2, 790.0, 1580.0),
    "NVIDIA H100 80GB HBM3": Card(3.0, 798.0, 1596.0),
}
BAR_CARD = "NVIDIA H200"  # the card issue 29's bars were set on


def this_card_bandwidth() -> float:
    """The copy bandwidth of the CUDA card this process runs on, TB/s, for the GPU scripts' limits
    (the H200's where the card is not in CARDS)."""
    import torch

    bandwidth = CARDS.get(torch.cuda.get_device_name(), CARDS[BAR_CARD]).bandwidth
    assert bandwidth is not None  # every card of CARDS has one
    return bandwidth


def host_gap_ms(result: dict) -> float:
    """A `cde bench engine` level's ms per pass that the device waited for the host's launch."""
    return result["gpu_idle_fraction"] * result["wall_s"] * 1e3 / result["forward_passes"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="`cde bench engine --json` files")
    p.add_argument("--model", help="checkpoint directory whose config.json gives the shape (default: each run's)")
    p.add_argument("--bandwidth", type=float, help="device copy bandwidth, TB/s (default: the run's card's)")
    p.add_argument("--peak", type=float, help="bfloat16 dense peak, TFLOP/s (default: the run's card's)")
    p.add_argument("--fp8-peak", type=float, help="FP8 dense peak, TFLOP/s (default: the card's, else twice --peak)")
    p.add_argument(
        "--card",
        default=BAR_CARD,
        help="the card of a report that names none, as torch names it (default: %(default)s, every such run's)",
    )


def card_of(report: dict, args: argparse.Namespace) -> tuple[str, Card]:
    """The run's card and its limits, each overridden by its flag; a limit of a card not in CARDS
    without its flag is unknown (None)."""
    name = report.get("device", args.card)
    known = CARDS.get(name, Card(None, None, None))
    peak = args.peak or known.peak
    fp8_peak = args.fp8_peak or (2 * args.peak if args.peak else known.fp8_peak)
    return name, Card(args.bandwidth or known.bandwidth, peak, fp8_peak)


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
    met: bool | None = None  # None: no bar, or one set on another card
    card: str = ""

    @property
    def roofline_ms(self) -> float | None:
        return None if self.read_ms is None or self.flop_ms is None else max(self.read_ms, self.flop_ms)


def limits(s: Shape, quant: str, items: int, context: float, card: Card) -> tuple[float | None, float | None]:
    """The weight-read and tensor-core limits of one pass on `card`, ms (None: the card's figure unknown)."""
    peak = card.fp8_peak if quant == "fp8" else card.peak
    read = None if card.bandwidth is None else weight_bytes(s, quant) / (card.bandwidth * 1e12) * 1e3
    return read, None if peak is None else pass_flops(s, items, context) / (peak * 1e12) * 1e3


def judged(bar: str, met: bool, card: str) -> tuple[str, bool | None]:
    """A bar and whether the row meets it, where the row ran on the card the bars were set on."""
    return (bar, met) if card == BAR_CARD else (f"{bar} (on the {BAR_CARD.removeprefix('NVIDIA ')})", None)


def _requests(n: int) -> str:
    return f"{n} request{'s' if n > 1 else ''}"


def _label(quant: str, n: int) -> str:
    return f"{'bf16' if quant == 'none' else quant}, {_requests(n)}"


def engine_rows(report: dict, s: Shape, args: argparse.Namespace) -> list[Row]:
    settings = report["args"]
    name, card = card_of(report, args)
    prompt = float(str(settings.get("prompt_len", PAGE)).split(",")[0])
    context = prompt + float(settings.get("max_tokens", 0)) / 2
    out = []
    both = {r.get("async_scheduling") for r in report["results"]} == {False, True}  # --compare-async-scheduling
    for r in report["results"]:
        quant, n = r.get("quantization", "none"), int(r["concurrency"])
        ms, tok_s = r["ms_per_forward"], r["output_tok_per_s"]
        read_ms, flop_ms = limits(s, quant, n, context, card)
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
            bar, met = judged(bar, met and gc_share <= GC_BAR and recompiles == 0, name)
        out.append(Row(label, ms, tok_s, read_ms, flop_ms, gc_share, recompiles, gap_ms, bar=bar, met=met, card=name))
    return out


def long_rows(report: dict, s: Shape, args: argparse.Namespace) -> list[Row]:
    """FlashBlock bench rows: decode passes (one token per request each), attention per pass. A
    FlashBlock row has no tensor-core limit: reused attention skips the FLOPs the limit counts."""
    out = []
    name, card = card_of(report, args)
    max_tokens = float(report["args"].get("max_tokens", 0))
    for r in report["results"]:
        n, context = int(r["concurrency"]), int(r["context"])
        ms = 1e3 * n / r["decode_tok_per_s"]
        read_ms, exact_flop_ms = limits(s, "none", n, context - max_tokens / 2, card)
        flop_ms = exact_flop_ms if r["flashblock"] == "off" else None
        flash = r.get("sdpa_flash_ms_per_step")
        ratio = r["attention_ms_per_step"] / flash if flash else None
        compared = "" if ratio is None else f"attention {ratio:.2f}x SDPA flash"
        bar, met = "", None
        if r["flashblock"] == "off" and n == 1 and context >= LONG_CONTEXT:
            bar = f"<= {LONG_MS_BAR:g} ms and attention <= {FLASH_RATIO_BAR:g}x SDPA flash"
            met = ms <= LONG_MS_BAR and ratio is not None and ratio <= FLASH_RATIO_BAR
            bar, met = judged(bar, met, name)
        run = f"{s.n_layers} layers, {context // 1024}k, {_requests(n)}, FlashBlock {r['flashblock']}"
        out.append(Row(run, ms, r["decode_tok_per_s"], read_ms, flop_ms, None, None, None, compared, bar, met, name))
    return out


def http_rows(summary: dict, args: argparse.Namespace) -> list[Row]:
    out = []
    for c in summary["cells"]:
        gap = c["http_tok_s"] / c["engine_tok_s"] - 1
        run = f"HTTP, {_requests(int(c['concurrency']))}, attribution {'on' if c['attribution'] else 'off'}"
        compared = f"{100 * gap:+.1f}% vs the engine ({c['engine_tok_s']:.1f} tok/s)"
        bar = f"within {100 * HTTP_BAR:g}% of the engine"  # a ratio within one run: judged on any card
        card = summary.get("device", args.card)
        out.append(Row(run, None, c["http_tok_s"], None, None, None, None, None, compared, bar, gap >= -HTTP_BAR, card))
    return out


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def table(all_rows: list[Row]) -> str:
    lines = [
        "run | ms/pass | tok/s | weight-read limit ms | tensor-core limit ms | of roofline | GC | recompiles"
        " | host gap ms | compared with | issue 29 bar | met | card",
        "--- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | ---",
    ]
    for r in all_rows:
        share = None if r.ms is None or r.roofline_ms is None else 100 * r.roofline_ms / r.ms
        gc = "—" if r.gc_share is None else f"{100 * r.gc_share:.2f}% (<= {100 * GC_BAR:g}%)"
        lines.append(
            f"{r.run} | {_num(r.ms, '.2f')} | {r.tok_s:.1f} | {_num(r.read_ms, '.2f')} | {_num(r.flop_ms, '.2f')} | "
            f"{_num(share, '.0f')}{'%' if share is not None else ''} | {gc} | {_num(r.recompiles, 'd')} | "
            f"{_num(r.host_gap_ms, '.2f')} | "
            f"{r.compared or '—'} | {r.bar or '—'} | {'—' if r.met is None else 'yes' if r.met else 'no'} | "
            f"{r.card.removeprefix('NVIDIA ')}"
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
            all_rows += http_rows(report, args)
            continue
        s = report_shape(report, path, args)
        is_long = any("flashblock" in r for r in report["results"])
        all_rows += long_rows(report, s, args) if is_long else engine_rows(report, s, args)
    print(table(all_rows))
    return 0
