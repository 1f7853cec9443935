"""How torch runs on the CPU: how many threads its operators use in a worker (or `cde generate`),
and huge pages for its large tensors.

Threads: torch's default is one per core of the machine, which assumes the process has the machine
to itself: CPU workers that share it, or a machine other jobs keep busy, then run more threads than
free cores, and every operator waits for its slowest thread (on a 2-core machine at load 14, `cde
generate` on the demo took 83 s with torch's 2 threads and 21 s with 1; docs/operations.md, "CPU
threads").

Huge pages: a pass on the CPU writes each step's vocabulary-wide logits into a fresh tensor (64
rows of the 100,352-wide vocabulary: 26 MB in float32). Such a block comes from the kernel page by
page, so every step faults in thousands of 4 KB pages: of the 52 ms that [128, 64] x [64, 100,352]
takes on one core, 25 ms were page faults. torch's CPU allocator asks for transparent huge pages
(2 MB) for tensors of 2 MB and more when THP_MEM_ALLOC_ENABLE=1: the same product took 28 ms.
The bits are the same; only where the memory comes from changes."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("cde.worker")
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"  # torch's switch (c10's CPU allocator), read at its first large allocation


def use_huge_pages() -> None:
    """Huge pages for torch's large CPU tensors, unless the operator set the switch (0: off). Call
    it before the process allocates tensors (the CLI does, before any command imports torch). Where
    the kernel offers no transparent huge pages (`never` in /sys/kernel/mm/transparent_hugepage/
    enabled) it changes nothing; the tests' `huge_pages` test asserts it takes effect where offered."""
    os.environ.setdefault(HUGE_PAGES_ENV, "1")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: taskset, a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def choose_threads(requested: int | None, workers_on_host: int) -> tuple[int, str]:
    """(threads, why): `requested` (--threads) when given, else OMP_NUM_THREADS when set, else the
    usable cores shared among the host's workers, capped by the cores the rest of the machine
    leaves idle (the 1-minute load average)."""
    if requested is not None:
        return max(1, requested), "--threads"
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    cores = usable_cores()
    share = max(1, cores // max(1, workers_on_host))
    load = os.getloadavg()[0]
    idle = max(1, int(cores - load + 0.5))
    why = f"{cores} usable cores, {workers_on_host} worker(s) on this host, 1-minute load {load:.1f}"
    return min(share, idle), why


def set_cpu_threads(requested: int | None, workers_on_host: int = 1) -> int:
    import torch

    threads, why = choose_threads(requested, workers_on_host)
    torch.set_num_threads(threads)
    log.info("CPU threads: %d (%s)", threads, why, extra={"cpu_threads": threads})
    return threads
