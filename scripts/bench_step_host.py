#!/usr/bin/env python3
"""The engine's host time per step, of two checkouts side by side in one run (issue 31: the step
plan and the output stage must cost no more host time than what they replaced).

Each measurement is a fresh process running one checkout's engine (PYTHONPATH=<checkout>) on the
same random-weight checkpoint, on the CPU; the checkouts take turns, round after round, so a
change in the machine's load hits both alike. Per engine step it records:

- step: the wall time of `Engine.step()` (on the CPU mostly the forward pass itself);
- host: the time in the step's host work, each version's by name: the scheduler (`schedule`,
  and `update` + `attach` before / `place` after), the output stage (`OutputStage.finish`;
  before: input attribution's `process`), the runner's staging of the pass (the step inputs'
  `build`, `_steering_inputs`, `_split_inputs` or `forward.split_inputs`) and its reading of the results (`picks`,
  `records`);
- critical: the part of it from a pass's picks to the end of the next launch, which a GPU waits
  for (on the CPU nothing overlaps, but it is the same code).

    python scripts/bench_step_host.py --tree base=/tmp/cde-base --tree new=. --concurrency 1,32

Each request generates --max-tokens tokens, one per step, with a stop string that never matches
(its search runs at every completed block) and, with --attribution, concept attribution.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(args: argparse.Namespace) -> None:
    """One measurement in this process: the engine of the checkout on PYTHONPATH."""
    from cde.shared.protocol import AttributionSpec, GenerateRequest
    from cde.worker.engine import Engine, EngineArgs

    engine = Engine(EngineArgs(args.model, max_running=max(args.level, 1)))
    runner = engine.runner
    host = [0.0, 0.0]  # seconds of host work in the current step: all, and between picks and launch
    window = [False]  # between a pass's picks and the end of the next launch

    def timed(owner: object, name: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent = time.perf_counter() - t0
                host[0] += spent
                host[1] += spent if window[0] or name == "picks" else 0.0
                if name == "picks":  # what follows up to the end of the next launch, the device waits for
                    window[0] = True

        setattr(owner, name, wrapper)

    # The host work of each version, by name: the scheduler, the output stage (before: the
    # scheduler's update/attach and input attribution's process) and the runner's staging.
    for owner, names in (
        (engine.scheduler, ("schedule", "update", "attach", "place")),
        (getattr(engine, "outputs", None), ("finish",)),
        (getattr(engine, "inputs", None), ("process",)),
        (getattr(runner, "step_inputs", None) or runner.inputs, ("build",)),
        (runner, ("_steering_inputs", "_split_inputs", "picks", "records")),
        (getattr(runner, "forward", None), ("split_inputs",)),  # since the forward pass is its own object
    ):
        for name in names:
            if owner is not None and hasattr(owner, name):
                timed(owner, name)
    launch = runner.launch

    def launch_closing_the_window(plan):
        try:
            return launch(plan)
        finally:
            window[0] = False

    runner.launch = launch_closing_the_window

    def requests(tag: str) -> list:
        return [
            GenerateRequest(
                f"{tag}{i}",
                [(7 * i + j) % 5000 + 100 for j in range(args.prompt_len)],
                max_tokens=args.max_tokens,
                stop=["never appears in random tokens \u2603"],
                attribution=AttributionSpec() if args.attribution else None,
                seed=i,
            )
            for i in range(args.level)
        ]

    engine.generate(requests("warm"))
    steps, hosts, critical = [], [], []
    for r in requests("run"):
        engine.add_request(r)
    while engine.has_work():
        host[0] = host[1] = 0.0
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
        hosts.append(host[0])
        critical.append(host[1])

    def ms(xs: list[float]) -> float:
        return round(statistics.median(xs) * 1e3, 4)

    print(json.dumps({"steps": len(steps), "step_ms": ms(steps), "host_ms": ms(hosts), "critical_ms": ms(critical)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=[], help="NAME=CHECKOUT, one per version (two or more)")
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--preset", default="tiny", help="random-weight checkpoint preset (written once)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--attribution", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--level", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    trees = dict(t.split("=", 1) for t in args.tree)
    if len(trees) < 2:
        p.error("give two checkouts or more: --tree NAME=CHECKOUT --tree NAME=CHECKOUT")
    from cde.worker.checkpoint import make_model

    model_dir = tempfile.mkdtemp(prefix="bench-step-host-")
    atexit.register(shutil.rmtree, model_dir, ignore_errors=True)
    model = str(make_model(args.preset, Path(model_dir), seed=1))
    levels = [int(x) for x in args.concurrency.split(",")]
    runs: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.rounds):
        for level in levels:
            order = list(trees) if r % 2 == 0 else list(reversed(trees))  # each goes first in turn
            for name in order:
                cmd = [sys.executable, __file__, "--child", "--model", model, "--level", str(level)]
                cmd += ["--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens)]
                cmd += ["--attribution"] if args.attribution else []
                env = {**os.environ, "PYTHONPATH": str(Path(trees[name]).resolve())}
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                runs.setdefault((name, level), []).append(json.loads(out.strip().splitlines()[-1]))
                print(f"round {r} {name} c={level}: {runs[name, level][-1]}", file=sys.stderr)
    print("concurrency | tree | steps | step ms | host ms | critical ms  (medians over rounds of per-step medians)")
    for level in levels:
        for name in trees:
            rs = runs[name, level]
            med = {k: statistics.median(x[k] for x in rs) for k in ("step_ms", "host_ms", "critical_ms")}
            print(
                f"{level} | {name} | {rs[0]['steps']} | {med['step_ms']:.3f} | {med['host_ms']:.3f} | "
                f"{med['critical_ms']:.3f}"
            )


if __name__ == "__main__":
    main()
