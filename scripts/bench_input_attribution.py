"""Input attribution on the engine (issue 17): seconds of integrated gradients per 64-token block
for each `--steps`, and the decode throughput of `--others` concurrent requests while one request's
input attribution runs, against the same batch with that request not asking for it.

    python3 scripts/bench_input_attribution.py --model /tmp/m8b --steps 1,32 --others 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

from cde.shared.protocol import AttributionSpec, BlockResult, GenerateRequest, InputAttributionSpec
from cde.worker.engine import Engine, EngineArgs


def request(rid: str, prompt: list[int], max_tokens: int, steps: int | None) -> GenerateRequest:
    attribution = AttributionSpec(inputs=InputAttributionSpec(steps=steps)) if steps else None
    return GenerateRequest(rid, prompt, max_tokens=max_tokens, attribution=attribution, seed=0)


def run(engine: Engine, reqs: list[GenerateRequest]) -> dict[str, float]:
    """Run until the other requests (ids starting with "o") are done (then abort what is left), or
    until all are. The window: from the step after the others' first block to their end (the
    attributed request's first block completes with theirs, so its attribution runs in it). Returns
    the others' tokens per second over the window, and the share of the window's steps during
    which input attribution was pending."""
    for r in reqs:
        engine.add_request(r)
    others = {r.request_id for r in reqs if r.request_id.startswith("o")}
    done: set[str] = set()
    window = None
    tokens, steps, pending_steps = 0, 0, 0
    while engine.has_work():
        if others and others <= done:
            for r in reqs:
                engine.abort(r.request_id)
            break
        pending = engine.outputs.input_attribution.has_work()
        results = engine.step()
        if window is not None:
            steps += 1
            pending_steps += pending
        for res in results:
            if isinstance(res, BlockResult) and res.request_id in others:
                if window is None:
                    window = time.perf_counter()
                else:
                    tokens += len(res.token_ids)
                if res.finished:
                    done.add(res.request_id)
    wall = time.perf_counter() - window if window is not None else 0.0
    return {"tok_s": tokens / wall if wall else 0.0, "pending_share": pending_steps / max(steps, 1)}


def others(args: argparse.Namespace, prompt: list[int]) -> list[GenerateRequest]:
    return [request(f"o{i}", prompt, args.max_tokens, None) for i in range(args.others)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", default="1,32")
    ap.add_argument("--others", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256, help="of the other requests")
    ap.add_argument("--blocks", type=int, default=1, help="blocks the attributed request generates")
    ap.add_argument("--json")
    args = ap.parse_args()
    engine = Engine(EngineArgs(args.model, device=args.device, max_running=args.others + 1))
    prompt = [(7919 * i) % 100000 for i in range(args.prompt_len)]
    run(engine, [request("warm", prompt, 64, 1)])  # kernels chosen, allocator grown
    rows = []
    for steps in [int(s) for s in args.steps.split(",")]:
        n_attr = 64 * args.blocks
        # Alone: the attribution runs back to back.
        engine.outputs.input_attribution.seconds = 0.0
        run(engine, [request("alone", prompt, n_attr, steps)])
        per_block = engine.outputs.input_attribution.seconds / args.blocks
        # With others decoding: their throughput with the request not asking, then asking.
        plain = run(engine, [*others(args, prompt), request("x", prompt, n_attr, None)])
        engine.outputs.input_attribution.seconds = 0.0
        attributed = run(engine, [*others(args, prompt), request("x", prompt, n_attr, steps)])
        drop = 1 - attributed["tok_s"] / plain["tok_s"]
        row = {
            "steps": steps,
            "seconds_per_block_alone": round(per_block, 3),
            "others": args.others,
            "others_tok_s_plain": round(plain["tok_s"], 1),
            "others_tok_s_with_attribution": round(attributed["tok_s"], 1),
            "drop_pct": round(100 * drop, 1),
            "attribution_pending_share_of_steps": round(attributed["pending_share"], 3),
            "attribution_seconds_under_load": round(engine.outputs.input_attribution.seconds, 2),
            "share": engine.outputs.input_attribution.share,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("steps | s per 64-token block (alone) | others tok/s plain | with attribution | drop")
    for r in rows:
        print(
            f"{r['steps']} | {r['seconds_per_block_alone']} | {r['others_tok_s_plain']} | "
            f"{r['others_tok_s_with_attribution']} | {r['drop_pct']}%"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
