"""Generate from one prompt with the offline engine (no server). `--steering` and `--attribution`
take the JSON of the API's `steering` and `attribution` fields, checked by the gateway's own code."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import uuid
from typing import TYPE_CHECKING, Any

from cde.commands.model_args import add_model_arguments, resolve_model_args
from cde.commands.settings_builder import engine_args
from cde.commands.worker import (
    DEVICE_HELP,
    DEVICES,
    DTYPE_HELP,
    DTYPES,
    add_quantization_arguments,
    add_thread_arguments,
    check_quantization_device,
)

if TYPE_CHECKING:
    from cde.shared.packed_attribution import PackedAttribution
    from cde.worker.engine import Engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (encoded as is: no chat template); this or --prompt-ids is required")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids; this or --prompt is required")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0: off")
    p.add_argument("--seed", type=int, help="sampling seed (default: random)")
    p.add_argument("--tokens-per-step", type=int, default=1, help="tokens unmasked per denoising step")
    p.add_argument(
        "--confidence-threshold", type=float, help="also unmask every position at least this confident (default: off)"
    )
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1: off")
    p.add_argument("--entropy-sampling", action="store_true", help="the reference's entropy-adaptive sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--steering",
        metavar="JSON",
        help='the API\'s `steering` object, e.g. \'{"concepts": ["ocean"], "preset": "amplify"}\' (default: unsteered)',
    )
    p.add_argument(
        "--attribution",
        metavar="JSON",
        help='the API\'s `attribution` field: true, or e.g. \'{"top_k": 5, "per_token": true}\' (default: off)',
    )
    p.add_argument(
        "--concept-labels",
        metavar="PATH",
        help="concept labels for steering by name and for attribution (default: as `cde serve` finds them)",
    )
    p.add_argument("--device", default="auto", choices=DEVICES, help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    add_quantization_arguments(p)
    add_thread_arguments(p, workers=False)
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"token_ids": [...], "text": "..."}, plus "attribution" as the API renders it',
    )


def run(args: argparse.Namespace) -> int:
    # torch loads only for the command that needs it: `cde gateway` / `cde serve` stay slim.
    from cde.shared.protocol import BlockResult, GenerateRequest
    from cde.worker.devices import resolve_device
    from cde.worker.engine import Engine

    settings = engine_args(args, max_running=1)
    device = resolve_device(settings.device)
    check_quantization_device(settings.quantization, device)
    resolve_model_args(args, "generate")
    if device == "cpu":
        from cde.worker.cpu_threads import set_cpu_threads

        set_cpu_threads(args.threads)
    engine = Engine(dataclasses.replace(settings, model=args.model))
    tok = engine.tokenizer
    if args.prompt is not None:
        prompt_ids = tok.encode(args.prompt)
    else:
        prompt_ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    req = GenerateRequest(
        uuid.uuid4().hex,
        prompt_ids,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        tokens_per_step=args.tokens_per_step,
        confidence_threshold=args.confidence_threshold,
        repetition_penalty=args.repetition_penalty,
        entropy_sampling=args.entropy_sampling,
        stop=args.stop,
    )
    render = None
    if args.steering is not None or args.attribution is not None:
        req.steering, req.attribution, render = _api_fields(args, engine, prompt_ids)
    engine.add_request(req)
    ids: list[int] = []
    blocks: list[PackedAttribution] = []  # one per block, joined by the renderer
    eot_at: int | None = None  # where <|eot_id|> ended the generation
    while engine.has_work():
        for res in engine.step():
            if isinstance(res, BlockResult):
                if res.finish_reason == "error":  # the engine's log above says why
                    raise SystemExit(f"cde generate: the request failed: {res.error}")
                ids += res.token_ids
                eot_at = res.end_position
                if res.attribution is not None:
                    blocks.append(res.attribution)
    text = tok.decode(ids)
    if args.stop:
        from cde.shared.stops import find_stop

        found = find_stop(text, args.stop)
        if found is not None:
            text = text[: found[0]]
    attribution = render(blocks, len(ids), eot_at) if render else None  # over the token_ids it prints
    if args.json:
        print(json.dumps({"token_ids": ids, "text": text, **({"attribution": attribution} if attribution else {})}))
    else:
        print(text)
        if attribution:
            print(json.dumps(attribution, indent=2))
    return 0


def _api_fields(args: argparse.Namespace, engine: Engine, prompt_ids: list[int]) -> Any:
    """The request's steering and attribution specs, parsed and checked as the API parses and
    checks them (labels, presets, bounds), and the API's attribution renderer."""
    from pydantic import ValidationError

    from cde.commands.gateway import concept_labels
    from cde.gateway.attribution_render import renderer
    from cde.gateway.errors import ApiError, from_validation_error
    from cde.gateway.model_info import ModelInfo
    from cde.gateway.params import generate_requests
    from cde.gateway.schemas import CompletionRequest

    body = {"model": "cli", "prompt": prompt_ids}
    for field in ("steering", "attribution"):
        raw = getattr(args, field)
        if raw is not None:
            try:
                body[field] = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise SystemExit(f"cde generate: --{field} is not JSON: {exc}") from None
    info = ModelInfo.from_config("cli", engine.cfg)
    labels = concept_labels(args, args.model)
    try:
        try:
            parsed = CompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        [api] = generate_requests(parsed, [prompt_ids], args.max_tokens, info, labels, "cli")
    except ApiError as exc:
        raise SystemExit(f"cde generate: {exc.message}" + (f" (param: {exc.param})" if exc.param else "")) from None
    render = renderer([api], engine.tokenizer, labels, info)
    return api.steering, api.attribution, functools.partial(render, 0)
