"""The training loop: seeded batches and noise (a pure function of seed and step), AdamW with
warm-up and cosine decay over the run's budget, bf16 autocast on CUDA, optional torch.compile of
the transformer, a checkpoint that resumes exactly where the last call stopped, held-out accuracy
through CDE's own engine, and the export of the final model.

A run's budget is --steps (exactly reproducible) or --minutes of training time summed over
resumes (the step count then depends on the machine's speed); --stop-after ends this call in
time to save, for device calls of limited length."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import count
from pathlib import Path

import torch

from cde.shared.config import ModelConfig
from cde.train import heldout
from cde.train.export import archive, export
from cde.train.objective import Topics, Weights, losses
from cde.train.reference_concepts import concepts, topic_concept
from cde.train.rows import Batches
from cde.train.steer_response import logits_per_strength
from cde.train.token_set import topic_words, used_ids
from cde.train.train_model import TrainModel
from cde.train.vocab import TOPICS


@dataclass
class Options:
    out: str
    config: ModelConfig
    seed: int = 0
    steps: int | None = None
    minutes: float = 15.0
    stop_after: float | None = None  # minutes of wall time for this call
    stop_step: int | None = None  # or end this call at this step
    rows: int = 128
    length: int = 512
    lr: float = 2e-3
    warmup: int = 200
    device: str = "cpu"
    compile: bool = False
    workers: int = 0
    log_every: int = 50
    eval_every: float = 3.0  # minutes of training between held-out evaluations
    eval_problems: int = 32  # per family
    checkpoint_every: float = 2.0  # minutes
    weights: Weights = None  # type: ignore[assignment]


def _log(run: Path, record: dict) -> None:
    print(json.dumps(record), flush=True)
    with (run / "log.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")


def _lr(o: Options, step: int, progress: float, warm_from: int) -> float:
    warm = min(1.0, (step - warm_from + 1) / o.warmup)
    return o.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def build(o: Options, used: list[int]) -> tuple[TrainModel, torch.optim.Optimizer, Topics]:
    torch.manual_seed(o.seed)
    model = TrainModel(o.config, used).to(o.device)

    # Concept embeddings are not decayed: the steering and align terms read them through unit(E),
    # blind to the norm, so decay shrank the topic embeddings ~20x below the others and
    # attribution (sigmoid * E . W_y) ranked the topic 13th of 16 (docs/reference-model.md).
    def decayed(name: str, p: torch.Tensor) -> bool:
        return p.dim() >= 2 and name != "known_head.concept_embedding.weight"

    decay = [p for n, p in model.named_parameters() if decayed(n, p)]
    rest = [p for n, p in model.named_parameters() if not decayed(n, p)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=o.lr,
        betas=(0.9, 0.95),
        fused=o.device.startswith("cuda"),
    )
    ids = torch.tensor([topic_concept(t.name) for t in TOPICS], device=o.device)
    topics = Topics(ids, topic_words(model.lookup.cpu(), model.n_used + 1).to(o.device))
    return model, opt, topics


def _forward_backward(
    model: TrainModel,
    topics: Topics,
    batch: dict,
    gen: torch.Generator,
    o: Options,
    residual: Callable[..., torch.Tensor] | None,
) -> dict:
    with torch.autocast("cuda", torch.bfloat16, enabled=o.device.startswith("cuda")):
        out = losses(model, topics, batch, gen, o.weights, residual)
    out["total"].backward()
    return out


def _save(run: Path, model: TrainModel, opt: torch.optim.Optimizer, state: dict) -> None:
    """state.pt: everything, to resume on this machine. weights.pt: the weights in bf16 and the
    schedule's position (small enough to travel when the machine is gone; Adam restarts)."""
    for name, blob in (
        ("state.pt", {"model": model.state_dict(), "opt": opt.state_dict(), **state}),
        ("weights.pt", {"model": {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, **state}),
    ):
        torch.save(blob, run / f"{name}.tmp")
        (run / f"{name}.tmp").replace(run / name)


def evaluate(o: Options, model: TrainModel, run: Path) -> dict:
    """Held-out accuracy of the current weights, decoded by CDE's engine in this process one token
    per step from the chat prompt's token ids (heldout.on_engine: no HTTP layer), and how far
    amplify steering moves the logits (steer_response.py: the retrain that lost amplify read 0.08
    where the shipped model reads 0.18), and how often suppressing the top attributed concept's
    direction lowers the token more than another active one's (the eval's faithfulness, injection
    alone)."""
    from cde.eval.faithfulness import logit_drops
    from cde.shared.settings import EngineArgs
    from cde.worker.engine import Engine

    snap = export(model, run / "snapshot", torch.float32)
    engine = Engine(EngineArgs(str(snap), device=o.device, max_running=64, cuda_graphs=False))
    return {
        "heldout": heldout.on_engine(engine, heldout.problems(o.eval_problems, o.seed)),
        "logits_per_strength": round(logits_per_strength(model), 4),
        "faithful": round(logit_drops(model, len(TOPICS))["injection"]["top_beats_other"], 4),
    }


def train(o: Options, resume: bool = False, weights: str | None = None) -> Path:
    """resume: continue from out/state.pt; weights: start from a weights.pt (fresh optimizer,
    re-warmed), the schedule continuing from its step."""
    run = Path(o.out)
    run.mkdir(parents=True, exist_ok=True)
    o.weights = o.weights or Weights()
    vocab_file = run / "used_ids.json"
    if not vocab_file.is_file():
        vocab_file.write_text(json.dumps(used_ids()))
    model, opt, topics = build(o, json.loads(vocab_file.read_text()))
    state = {"step": 0, "elapsed": 0.0, "warm_from": 0}
    if resume and (run / "state.pt").is_file():
        saved = torch.load(run / "state.pt", map_location=o.device, weights_only=False)
        model.load_state_dict(saved.pop("model"))
        opt.load_state_dict(saved.pop("opt"))
        state = saved
    elif weights:
        saved = torch.load(weights, map_location=o.device, weights_only=False)
        model.load_state_dict({k: v.float() for k, v in saved.pop("model").items()})
        state = {**saved, "warm_from": saved["step"]}
    (run / "options.json").write_text(json.dumps({**asdict(o), "config": asdict(o.config)}, default=str, indent=2))
    compiled = o.compile
    # Static shapes: the faithfulness term runs its own fixed number of rows through the same
    # forward, one more graph rather than a dynamic-batch one.
    residual = torch.compile(model.residual, dynamic=False) if compiled else model.residual
    data = torch.utils.data.DataLoader(
        Batches(o.seed, o.rows, o.length, len(concepts()), 1 << 40),
        batch_size=None,
        sampler=range(state["step"], 1 << 40),
        num_workers=o.workers,
        pin_memory=o.device.startswith("cuda"),
        persistent_workers=o.workers > 0,
        prefetch_factor=8 if o.workers else None,
    )
    _log(
        run,
        {
            "start_step": state["step"],
            "device": o.device,
            "used_ids": model.n_used,
            "parameters": sum(p.numel() for p in model.parameters()),
        },
    )
    first_step = state["step"]
    started = tick = time.perf_counter()
    last_save = last_eval = state["elapsed"]
    window, window_start = [], time.perf_counter()
    for step, batch in zip(count(state["step"]), data):
        progress = step / o.steps if o.steps else state["elapsed"] / (o.minutes * 60)
        out_of_time = o.stop_after and time.perf_counter() - started > o.stop_after * 60
        if progress >= 1.0 or out_of_time or (o.stop_step is not None and step >= o.stop_step):
            break
        for g in opt.param_groups:
            g["lr"] = _lr(o, step, progress, state["warm_from"])
        batch = {k: v.to(o.device, non_blocking=True) for k, v in batch.items()}
        gen = torch.Generator(o.device).manual_seed(o.seed * 1_000_003 + step)
        opt.zero_grad(set_to_none=True)
        try:
            out = _forward_backward(model, topics, batch, gen, o, residual)
        except Exception as exc:  # a compiler failure must not cost the run
            if not compiled:
                raise
            _log(run, {"step": step, "compile_failed": repr(exc)[:500], "continuing": "eager"})
            residual, compiled = model.residual, False
            opt.zero_grad(set_to_none=True)
            gen = torch.Generator(o.device).manual_seed(o.seed * 1_000_003 + step)
            out = _forward_backward(model, topics, batch, gen, o, residual)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window.append({k: v.detach() for k, v in out.items()})
        state["step"] = step + 1
        # Training time is wall time between steps (data waits included), checkpoints and
        # evaluations excluded: the budget buys optimisation, whatever the bottleneck.
        # The first step of a call compiles: not training time.
        state["elapsed"] += time.perf_counter() - tick if step > first_step else 0.0
        tick = time.perf_counter()
        if state["step"] % o.log_every == 0:
            mean = {k: round(float(torch.stack([w[k] for w in window]).mean()), 4) for k in window[0]}
            rate = len(window) * o.rows / (time.perf_counter() - window_start)
            _log(
                run,
                {
                    "step": state["step"],
                    "elapsed_s": round(state["elapsed"], 1),
                    "lr": round(_lr(o, step, progress, state["warm_from"]), 6),
                    "rows_s": round(rate, 1),
                    **mean,
                },
            )
            window, window_start = [], time.perf_counter()
        if state["elapsed"] - last_save > o.checkpoint_every * 60:
            _save(run, model, opt, state)
            last_save, tick = state["elapsed"], time.perf_counter()
        if o.eval_problems and state["elapsed"] - last_eval > o.eval_every * 60:
            _log(run, {"step": state["step"], **evaluate(o, model, run)})
            last_eval = state["elapsed"]
            window, window_start = [], time.perf_counter()
            tick = window_start
    _save(run, model, opt, state)
    done = (state["step"] >= o.steps) if o.steps else state["elapsed"] >= o.minutes * 60
    if o.eval_problems:
        _log(run, {"step": state["step"], **evaluate(o, model, run)})
    model_dir = export(model, run / "model")
    archive(model_dir, run / "model.tar.xz")
    _log(
        run, {"exported": str(model_dir), "archive_bytes": (run / "model.tar.xz").stat().st_size, "budget_spent": done}
    )
    return model_dir
