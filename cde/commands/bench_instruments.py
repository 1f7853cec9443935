"""What `cde bench engine` measures around a run: the device time of every forward pass and the
time the device waited for the host (`StepClock`), Python's garbage collections (`GcClock`), and
op tables of profiled steps (`profile_steps`, `--profile`)."""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING

import torch

from cde.shared.config import PAGE
from cde.worker.device_clock import elapsed_ms, mark

if TYPE_CHECKING:
    from cde.shared.protocol import GenerateRequest
    from cde.worker.engine import Engine
    from cde.worker.model_runner import Pass
    from cde.worker.plan import Picks, StepPlan


class StepClock:
    """Times every forward pass: on CUDA from its launch to the next one's on the device's own
    clock (the engine launches a pass while the last one's attribution runs), on the host
    otherwise; and the time the device sat idle waiting for the host's launches over the run
    (the engine's own `DeviceClock`, which the worker reports too)."""

    def __init__(self, engine: Engine):
        self.cuda = engine.runner.device.type == "cuda"
        self.runner = runner = engine.runner
        self.starts: list = []  # per launched pass: an event (CUDA) or a host time
        self.device_clock = engine.device_clock
        self.idle_before = engine.device_clock.idle_ms()
        self.finished = 0
        self.end = None  # marked when a pass's picks reach the host
        self.last_decode = False  # the last finished pass held no prefill item
        self.inner = runner.launch, runner.picks

        def launch(plan: StepPlan, after: Pass | None = None) -> Pass:
            self.starts.append(mark(self.cuda))
            return self.inner[0](plan, after)

        def picks(p: Pass) -> list[Picks]:
            out = self.inner[1](p)
            self.end = mark(self.cuda)
            self.finished += 1
            self.last_decode = all(it.is_step or it.block >= it.request.prompt_len // PAGE for it in p.plan.items)
            return out

        runner.launch, runner.picks = launch, picks

    def restore(self) -> None:
        self.runner.launch, self.runner.picks = self.inner

    def device_ms(self) -> tuple[list[float], float]:
        """ms per pass, and the ms the device sat idle waiting for the next launch."""
        if self.cuda:
            torch.cuda.synchronize()
        marks = self.starts + [self.end]
        per_pass = [elapsed_ms(a, b) for a, b in zip(marks, marks[1:])]
        return per_pass, self.device_clock.idle_ms() - self.idle_before


class GcClock:
    """Python garbage collections during a run and the time they took (they stall the step they
    interrupt)."""

    def __init__(self) -> None:
        self.count, self.seconds, self._t0 = 0, 0.0, 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._t0

    def stop(self) -> None:
        gc.callbacks.remove(self._on)


# What a device kernel is, from its name (first match wins): the kinds issue 29's analysis weighs.
KERNEL_KINDS = (
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
    ("attention", ("flex_attention", "flex_decoding", "triton_tem_")),
    ("top-k and sorts", ("topk", "sort", "radix", "bitonic")),
    ("other Triton (fused pointwise, norms, reductions)", ("triton_", "_kernel")),
    ("copies and fills", ("memcpy", "memset", "copy", "fill")),
)


def kernel_breakdown(kernels: list[tuple[str, float]], steps: int) -> str:
    """(kernel name, device us) pairs -> ms per step by kind, largest first, and each kind's
    three largest kernels: where a pass's device time goes, in a few lines."""
    kinds: dict[str, dict[str, float]] = {}
    for name, us in kernels:
        low = name.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(key in low for key in keys)), "other")
        by_name = kinds.setdefault(kind, {})
        by_name[name] = by_name.get(name, 0.0) + us
    total = sum(us for _, us in kernels) or 1.0
    lines = [f"-- device time by kind, ms per step ({steps} steps)"]
    for kind, names in sorted(kinds.items(), key=lambda kv: -sum(kv[1].values())):
        us = sum(names.values())
        top = ", ".join(f"{n[:60]} {v / 1e3 / steps:.3f}" for n, v in sorted(names.items(), key=lambda kv: -kv[1])[:3])
        lines.append(f"{kind}: {us / 1e3 / steps:.3f} ({100 * us / total:.0f}%): {top}")
    return "\n".join(lines)


def profile_steps(engine: Engine, reqs: list[GenerateRequest], path: str) -> None:
    """Op tables of 32 steps inside the first generated block and of the 32 across its end (where
    a block's once-per-block work runs: its concept attribution, the next block's placement), side
    by side in one file: per step, the second minus the first is that work's share."""
    from torch.profiler import ProfilerActivity, profile

    for r in reqs:
        engine.add_request(r)
    tables = []
    for label, skip in (("block 0, steps 8-39", 8), (f"steps 48-79, across block 0's end at {PAGE}", 8)):
        for _ in range(skip):
            engine.step()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(32):
                engine.step()
        wall_ms = (time.perf_counter() - t0) * 1e3 / 32
        ops = prof.key_averages()
        # Kernel time against wall time per step: what is left is the GPU waiting for the host.
        # Device rows only, as torch's own table total: a CPU op's self device time repeats its kernels'.
        cuda = torch.autograd.DeviceType.CUDA
        kernels = [(e.key, e.self_device_time_total) for e in ops if e.device_type == cuda and not e.is_user_annotation]
        kernel_ms = sum(us for _, us in kernels) / 1e3 / 32
        tables.append(
            f"== {label}: {wall_ms:.2f} ms/step wall (profiled), {kernel_ms:.2f} ms/step of device work\n"
            + kernel_breakdown(kernels, 32)
            + "\n"
            + ops.table(sort_by="cuda_time_total", row_limit=40)
            + "\n-- host side\n"
            + ops.table(sort_by="self_cpu_time_total", row_limit=25)
        )
    # The tables are written: finishing the requests would measure nothing more.
    for r in reqs:
        engine.abort(r.request_id)
    while engine.has_work():
        engine.step()
    with open(path, "w") as f:
        f.write("\n".join(tables))
    print("\n".join(tables))
