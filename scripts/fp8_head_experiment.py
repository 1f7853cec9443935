"""Issue 29 experiment: would an e4m3 LM head keep `--quantization fp8`'s tokens?

At one fp8 request the bfloat16 LM head is 0.20 ms of a 3.53 ms pass (its 0.82 GB at the copy
bandwidth, H200, 2026-12-05); in e4m3 it would read half of that. This script asks first what it
would cost in tokens, on the CPU with the trained demo model (or --model): greedy generations of
bfloat16, fp8 blocks (what `--quantization fp8` quantizes), fp8 blocks with an e4m3 head, and
bfloat16 blocks with an e4m3 head, each against bfloat16's tokens, plus the e4m3 head's own
deviation on bfloat16's final hidden rows. The head is quantized as the blocks' linears are (one
scale per output row, per-token activation scales, the product in float32: worker/fp8.py's CPU
emulation).
Run: PYTHONPATH=. python3 scripts/fp8_head_experiment.py [--prompts 16] [--tokens 64] [--model DIR]
"""

from __future__ import annotations

import argparse

import torch
from cde.kernels.fp8_ops import quantize_rows
from cde.shared.protocol import GenerateRequest
from cde.shared.tokenizer import get_tokenizer
from cde.worker.demo_model import demo_model_dir
from cde.worker.engine import Engine, EngineArgs
from cde.worker.fp8 import deviation
from cde.worker.model_runner import ModelRunner

TEXTS = [
    "The ocean is", "Once upon a time", "The history of the Roman empire", "In mathematics, a prime number",
    "My favourite food is", "The weather today", "Scientists have discovered", "The city of Paris",
    "Music is", "A good teacher", "The first computer", "Dogs and cats",
    "The river flows", "In the morning I", "The best way to learn", "Space exploration",
]  # fmt: skip


def e4m3_head(runner: ModelRunner) -> None:
    """The runner's logits from an e4m3 copy of its LM head."""
    q, scale = quantize_rows(runner.lm_head.float())
    weight = q.float() * scale

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        hq, h_scale = quantize_rows(hidden.float())
        return ((hq.float() * h_scale) @ weight.t()).to(hidden.dtype)

    runner._logits = logits


def generate(
    model: str, prompts: list[list[int]], tokens: int, quantization: str, head: bool, seen: list[torch.Tensor]
) -> list[list[int]]:
    """Greedy tokens per prompt; `seen` collects the final hidden rows whose logits were read."""
    engine = Engine(EngineArgs(model, dtype="bfloat16", quantization=quantization, max_running=len(prompts)))
    runner = engine.runner
    if head:
        e4m3_head(runner)
    else:  # bfloat16's final hidden rows, for the head's own deviation
        plain = runner._logits
        runner._logits = lambda hidden: seen.append(hidden) or plain(hidden)
    out = engine.generate([GenerateRequest(str(i), p, max_tokens=tokens) for i, p in enumerate(prompts)])
    return [out[str(i)] for i in range(len(prompts))]


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="a model directory (default: the demo model)")
    args = ap.parse_args()
    model = args.model or str(demo_model_dir())
    tok = get_tokenizer()
    prompts = [tok.encode(t) for t in (TEXTS * (args.prompts // len(TEXTS) + 1))[: args.prompts]]
    hidden: list[torch.Tensor] = []
    reference = generate(model, prompts, args.tokens, "none", False, hidden)
    print(f"{args.prompts} prompts x {args.tokens} greedy tokens against bfloat16's\n")
    print("| variant | identical generations | mean first divergence (tokens) |")
    print("| --- | --- | --- |")
    for name, quantization, head in [
        ("fp8 blocks (`--quantization fp8`)", "fp8", False),
        ("fp8 blocks + e4m3 LM head", "fp8", True),
        ("bfloat16 blocks + e4m3 LM head", "none", True),
    ]:
        got = generate(model, prompts, args.tokens, quantization, head, [])
        same = sum(a == b for a, b in zip(reference, got))
        first = sum(first_divergence(a, b) for a, b in zip(reference, got)) / len(got)
        print(f"| {name} | {same}/{len(got)} | {first:.1f} |")
    rows = torch.cat(hidden)  # the head alone, on bfloat16's hidden rows (at most ~2,048: [R, 100k] logits)
    rows = rows[:: max(1, rows.shape[0] // 2048)]
    runner = Engine(EngineArgs(model, dtype="bfloat16", max_running=1)).runner
    with torch.inference_mode():  # as the engine calls the runner
        plain = runner._logits(rows)
        e4m3_head(runner)
        d = deviation(plain, runner._logits(rows))
    print(
        f"\nthe e4m3 head alone on {rows.shape[0]} bfloat16 hidden rows: "
        + ", ".join(f"{k} {v:.3g}" for k, v in d.items())
    )


if __name__ == "__main__":
    main()
