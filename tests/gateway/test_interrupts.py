"""`Interrupts` with real signals sent to this process (the end-to-end cases with `cde serve` are
in tests/api/test_api_signals.py)."""

import os
import signal
import sys

import pytest
from cde.gateway.interrupts import Interrupts


@pytest.fixture(autouse=True)
def restored_handlers(monkeypatch):
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    # Python's own: pytest's would re-raise the KeyboardInterrupt that Python drops.
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def send(sig: int) -> None:
    os.kill(os.getpid(), sig)
    for _ in range(1000):  # the handler runs at the loop's next check
        pass


class LandsHere:
    """Its `__del__` is where the signal lands: Python prints an exception raised there and drops it."""

    def __init__(self, sig: int):
        self.sig = sig

    def __del__(self):
        send(self.sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_before_the_workers_start_a_signal_is_raised_where_it_lands(sig):
    Interrupts()
    with pytest.raises(KeyboardInterrupt):
        send(sig)


def test_one_dropped_before_the_workers_start_is_raised_when_they_do(capsys):
    interrupts = Interrupts()
    LandsHere(signal.SIGTERM)
    assert "KeyboardInterrupt" in capsys.readouterr().err  # printed and dropped
    assert interrupts.received
    with pytest.raises(KeyboardInterrupt):
        interrupts.defer()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("lands", ["code", "__del__"])
def test_once_the_workers_start_a_first_signal_is_only_recorded(sig, lands, capsys):
    interrupts = Interrupts()
    interrupts.defer()
    if lands == "code":
        try:
            send(sig)
        except KeyboardInterrupt:
            pytest.fail("the signal was raised where it landed")
    else:
        LandsHere(sig)
    assert "KeyboardInterrupt" not in capsys.readouterr().err  # nothing raised, so nothing dropped
    assert interrupts.received
    with pytest.raises(KeyboardInterrupt):
        interrupts.raise_if_received()


def test_a_second_signal_is_raised_at_once():
    interrupts = Interrupts()
    interrupts.defer()
    send(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        send(signal.SIGINT)


def test_no_signal_nothing_raised():
    interrupts = Interrupts()
    interrupts.defer()
    interrupts.raise_if_received()
    assert not interrupts.received
