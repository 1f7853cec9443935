"""Generate from one prompt with the offline engine (no server)."""

from __future__ import annotations

import json
import uuid


def add_arguments(p) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the built-in demo model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--tokens-per-step", type=int, default=1)
    p.add_argument("--confidence-threshold", type=float)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--entropy-sampling", action="store_true", help="the reference's entropy-adaptive sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    p.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": "..."}')


def run(args) -> int:
    # torch loads only for the command that needs it: `cde gateway` / `cde serve` stay slim.
    from shared.protocol import GenerateRequest
    from worker.checkpoint import demo_model_dir
    from worker.engine import Engine, EngineArgs

    engine = Engine(EngineArgs(args.model or str(demo_model_dir()), device=args.device, dtype=args.dtype, max_running=1))
    tok = engine.tokenizer
    if args.prompt is not None:
        prompt_ids = tok.encode(args.prompt)
    else:
        prompt_ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    req = GenerateRequest(
        uuid.uuid4().hex, prompt_ids, max_tokens=args.max_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, tokens_per_step=args.tokens_per_step,
        confidence_threshold=args.confidence_threshold, repetition_penalty=args.repetition_penalty,
        entropy_sampling=args.entropy_sampling, stop=args.stop,
    )
    ids = engine.generate([req])[req.request_id]
    text = tok.decode(ids)
    if args.stop:
        from shared.stops import find_stop

        found = find_stop(text, args.stop)
        if found is not None:
            text = text[: found[0]]
    print(json.dumps({"token_ids": ids, "text": text}) if args.json else text)
    return 0
