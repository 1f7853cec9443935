import pytest

from tests.cde_procs import Gateway


@pytest.fixture
def gateways():
    """Start `cde gateway` processes (`gateways(*flags)`); each is stopped after the test."""
    started = []
    yield lambda *args: started.append(Gateway(*args)) or started[-1]
    for g in started:
        g.stop()
