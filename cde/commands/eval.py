"""Quality of a trained reference model: held-out task accuracy per family with one token per
step and with each speed-up (tokens per step, confidence threshold, FlashBlock), tokens per
forward pass and tok/s side by side; steering efficacy (amplify, suppress); attribution
(top known concept of a chunk vs its topic; suppressing the top attributed concept vs another).
Against a server (`--url`, through the real API) or an engine in this process (`--model`).
Prints markdown tables; `--json` keeps everything."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from cde.cli_types import positive_int
from cde.commands.api_key_args import add_api_key_arguments, api_key
from cde.commands.model_args import MODEL_HELP, add_model_arguments, resolve_model_args
from cde.commands.worker import DEVICE_HELP, DEVICES

if TYPE_CHECKING:
    from cde.eval.backends import EngineBackend, HttpBackend

# name -> the API fields of the decoding setting (the seed's table)
SETTINGS: dict[str, dict | None] = {
    "one token per step": {},
    "tokens_per_step 2": {"tokens_per_step": 2},
    "tokens_per_step 4": {"tokens_per_step": 4},
    "confidence_threshold 0.9": {"confidence_threshold": 0.9},
    "confidence_threshold 0.7": {"confidence_threshold": 0.7},
    "FlashBlock (2/16)": {"flashblock": {"tau": 2, "max_reuse": 16}},
    "FlashBlock (2/63)": {"flashblock": {"tau": 2, "max_reuse": 63}},
}
SECTIONS = ("tasks", "steering", "attribution")


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    add_model_arguments(
        p, MODEL_HELP + ": run an engine in this process (default: cde-reference, unless --url is given)", into=src
    )
    src.add_argument("--url", help="a running CDE server, e.g. http://127.0.0.1:8000 (default: none, --model)")
    p.add_argument("--served-model", help="with --url: the model name (default: the server's first)")
    add_api_key_arguments(p, "with --url: send `Authorization: Bearer KEY`")
    p.add_argument("--device", default="cpu", choices=DEVICES, help="with --model; " + DEVICE_HELP)
    p.add_argument("--cuda-graphs", action="store_true", help="with --model on CUDA: the serving configuration")
    p.add_argument("--max-running", type=positive_int, default=64, help="with --model: concurrent requests")
    p.add_argument(
        "--limit",
        type=positive_int,
        default=100,
        help="held-out problems per family (and a smaller slice of the steering and attribution prompts when under 16)",
    )
    p.add_argument(
        "--settings",
        type=_names(SETTINGS, "setting"),
        default=",".join(SETTINGS),
        help="comma-separated rows of the task table",
    )
    p.add_argument(
        "--sections", type=_names(SECTIONS, "section"), default=",".join(SECTIONS), help=f"any of {', '.join(SECTIONS)}"
    )
    p.add_argument("--strengths", type=_numbers, default="0,4,8,16,32", help="amplify strengths (0: unsteered)")
    p.add_argument("--seed", type=int, default=0, help="which held-out problems")
    p.add_argument(
        "--json", metavar="PATH", help="write every number (and sample replies) here (default: only the tables)"
    )


def _names(known: Iterable[str], what: str) -> Callable[[str], str]:
    """A comma-separated list of `known` names, checked before anything runs (a long section must
    not end on a typo), kept as given."""

    def parse(text: str) -> str:
        wrong = next((n.strip() for n in text.split(",") if n.strip() not in known), None)
        if wrong is not None:
            raise argparse.ArgumentTypeError(f"unknown {what} {wrong!r} (choose from {', '.join(known)})")
        return text

    return parse


def _numbers(text: str) -> str:
    try:
        [float(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"numbers separated by commas, got {text!r}") from None
    return text


def _backend(args: argparse.Namespace) -> EngineBackend | HttpBackend:
    from cde.commands.settings_builder import engine_args
    from cde.eval.backends import EngineBackend, HttpBackend

    if args.url is not None:
        if not args.url.strip():
            raise SystemExit("cde eval: --url is empty (give a server's base URL, e.g. http://127.0.0.1:8000)")
        return HttpBackend(args.url, args.served_model, api_key(args))
    if args.model is not None and not args.model.strip():
        raise SystemExit("cde eval: --model is empty (give a checkpoint directory, or leave it out for cde-reference)")
    resolve_model_args(args, "eval")
    return EngineBackend(engine_args(args, device=_device(args), cuda_graphs=args.cuda_graphs))


def _device(args: argparse.Namespace) -> str:
    from cde.worker.devices import resolve_device

    return resolve_device(args.device)


def _tasks(backend: EngineBackend | HttpBackend, args: argparse.Namespace) -> list[dict]:
    from cde.train import heldout

    probs = heldout.problems(args.limit, args.seed)
    rows = []
    for name in args.settings.split(","):
        options = SETTINGS[name.strip()] or {}
        bodies = [
            {"messages": heldout.messages(p), "max_tokens": heldout.MAX_TOKENS, "temperature": 0.0, **options}
            for p in probs
        ]
        rows.append({"setting": name.strip(), **heldout.accuracy(probs, backend.run(bodies))})
    return rows


def _task_table(rows: list[dict]) -> str:
    families = list(rows[0]["accuracy"])
    base = sum(rows[0]["accuracy"].values()) / len(families)
    out = [
        "| setting | " + " | ".join(families) + " | mean | change | tokens/pass | tok/s |",
        "|---" * (len(families) + 5) + "|",
    ]
    for r in rows:
        mean = sum(r["accuracy"].values()) / len(families)
        cells = [f"{100 * r['accuracy'][f]:.1f}%" for f in families]
        out.append(
            f"| {r['setting']} | "
            + " | ".join(cells)
            + f" | {100 * mean:.1f}% | {100 * (mean - base):+.1f} | {r['tokens_per_step']:.2f} | {r['tok_s']:.1f} |"
        )
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:

    sections = [s.strip() for s in args.sections.split(",")]
    if args.json and not Path(args.json).resolve().parent.is_dir():  # before the run, not after it
        raise SystemExit(f"cde eval: --json {args.json}: no such directory {str(Path(args.json).parent)!r}")
    backend = _backend(args)
    n_topics = min(16, max(2, args.limit))
    report: dict = {}
    if "tasks" in sections:
        report["tasks"] = _tasks(backend, args)
        print("## Held-out task accuracy\n\n" + _task_table(report["tasks"]) + "\n")
    if "steering" in sections:
        _steering(backend, args, n_topics, report)
    if "attribution" in sections:
        _attribution(backend, args, n_topics, report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2, default=str)
    return 0


def _steering(backend: EngineBackend | HttpBackend, args: argparse.Namespace, n_topics: int, report: dict) -> None:
    from cde.eval import concept_eval

    strengths = [float(s) for s in args.strengths.split(",")]
    rows = concept_eval.amplify(backend, strengths, n_topics, n_prompts=min(6, args.limit))
    if args.url is None:  # the unsteered model's loss on each strength's replies (lower: more its own text)
        from cde.eval.fluency import chat_loss
        from cde.train.export import load
        from cde.train.steer_response import logits_per_strength

        model = load(args.model, _device(args))
        for r in rows:
            r["masked_token_loss"] = chat_loss(model, r["prompts"], r["replies"])
        report["logits_per_strength"] = logits_per_strength(model)
    report["amplify"] = rows
    report["suppress"] = concept_eval.suppress(backend, n_topics)
    fluency = "masked_token_loss" in rows[0]
    lines = ["| amplify strength | on-topic share | repeated 3-grams |" + (" masked-token loss |" if fluency else "")]
    lines.append("|---|---|---|" + ("---|" if fluency else ""))
    for r in rows:
        lines.append(
            f"| {r['strength']:g} | {100 * r['on_topic']:.1f}% | {100 * r['repeated_3grams']:.1f}% |"
            + (f" {r['masked_token_loss']:.3f} |" if fluency else "")
        )
    first = concept_eval.on_topic_strength(rows)
    reach = f"on-topic >= 80% from strength {first['strength']:g}" if first else "on-topic stays below 80%"
    if "logits_per_strength" in report:
        reach += (
            f"; the injection moves the logits by {report['logits_per_strength']:.3f} per unit of strength "
            "at the amplify preset's layer (1.0 as normalised)"
        )
    s = report["suppress"]
    print(
        "## Steering (neutral prompts, one topic concept amplified)\n\n"
        + "\n".join(lines)
        + f"\n\n{reach}\n\nsuppress preset on the asked topic: on-topic share {100 * s['baseline']:.1f}% -> "
        f"{100 * s['suppressed']:.1f}%\n"
    )


def _attribution(backend: EngineBackend | HttpBackend, args: argparse.Namespace, n_topics: int, report: dict) -> None:
    from cde.eval import concept_eval

    # Steered at the weakest strength that puts 80% on topic, else the strongest measured.
    first = concept_eval.on_topic_strength(report.get("amplify", []))
    strength = first["strength"] if first else max(float(s) for s in args.strengths.split(","))
    rows = [concept_eval.attribution(backend, n_topics), concept_eval.attribution(backend, n_topics, strength)]
    report["attribution"] = rows
    lines = [
        "| prompts | chunks | top is the topic | topic in the top 3 | top of the topic's group |",
        "|---|---|---|---|---|",
    ]
    for a in rows:
        what = f"neutral, amplified at {a['strength']:g}" if a["strength"] else "Tell me about <topic>."
        lines.append(
            f"| {what} | {a['chunks']} | {100 * a['top_is_topic']:.1f}% | {100 * a['topic_in_top3']:.1f}% "
            f"| {100 * a['top_in_topic_group']:.1f}% |"
        )
    print("## Attribution (the known concepts of each 64-token chunk)\n\n" + "\n".join(lines))
    if args.url is None:
        from cde.eval.faithfulness import logit_drops
        from cde.train.export import load

        f = logit_drops(load(args.model, _device(args)), n_topics, per_reply=4 if args.limit < 16 else 8)
        report["faithfulness"] = f
        inj = f["injection"]
        print(
            f"\nsuppressing the top attributed concept (the suppress preset) lowers the target logit by "
            f"{f['drop_top']:.3f}, another active concept by {f['drop_other']:.3f}; top > other at "
            f"{100 * f['top_beats_other']:.1f}% of {f['positions']} positions (the preset's injection alone: "
            f"{inj['drop_top']:.3f} vs {inj['drop_other']:.3f}, top > other at {100 * inj['top_beats_other']:.1f}%)"
        )
    print()
