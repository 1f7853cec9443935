"""worker/device_clock.py: the device's waits for the host between back-to-back passes (the CPU
clock: host times), and none while the engine has no work."""

import time

from cde.shared.protocol import GenerateRequest
from cde.shared.settings import EngineArgs
from cde.worker.device_clock import DeviceClock
from cde.worker.engine import Engine


def launch(clock: DeviceClock, then_wait_s: float = 0.0) -> None:
    clock.launching()
    clock.launched()
    time.sleep(then_wait_s)


def test_gaps_between_back_to_back_launches_add_up():
    clock = DeviceClock(cuda=False)
    launch(clock, 0.05)
    launch(clock, 0.03)
    launch(clock)
    assert 80 <= clock.idle_ms() < 200


def test_a_pause_breaks_the_chain_and_a_failed_launch_counts_nothing():
    clock = DeviceClock(cuda=False)
    launch(clock, 0.02)
    clock.pause()
    time.sleep(0.2)  # waiting for work
    launch(clock)
    assert clock.idle_ms() == 0.0
    time.sleep(0.02)
    clock.launching()  # raises before its pass is queued: no `launched`
    time.sleep(0.2)
    launch(clock)  # planned again: its gap runs from the last queued pass to this launch
    assert 200 <= clock.idle_ms() < 400


def test_the_engine_counts_its_passes_gaps_and_not_its_idle_time(tiny_dir):
    engine = Engine(EngineArgs(str(tiny_dir), max_running=2))
    req = GenerateRequest("a", [5, 6, 7], max_tokens=8, tokens_per_step=1)
    engine.generate([req])
    first = engine.stats()
    assert first.forward_passes >= 8 and first.device_idle_ms > 0
    time.sleep(1.0)
    engine.generate([GenerateRequest("b", [5, 6, 7], max_tokens=8, tokens_per_step=1)])
    second = engine.stats()
    # The second run's gaps, not the second the engine had nothing to do.
    assert 0 < second.device_idle_ms - first.device_idle_ms < first.device_idle_ms + 500
