"""scripts/netns_test.sh under pytest: gateway and two workers on three network-namespace "hosts"
over TCP + CURVE, one worker host losing its link and another going away.

It needs root for `ip netns`. Where that is refused the test fails with the script's message
rather than skipping: a green run must mean the multi-host path ran. Deselect it explicitly with
`-m "not netns"`."""

import os
import subprocess
import sys

import pytest

from tests.api_server import REPO


@pytest.mark.netns
@pytest.mark.serial  # three network namespaces, a gateway and two workers: the machine's network and cores
@pytest.mark.slow
def test_gateway_and_workers_on_three_hosts():
    run = subprocess.run(
        ["bash", str(REPO / "scripts" / "netns_test.sh")],
        cwd=REPO,
        timeout=400,
        check=False,
        env={**os.environ, "PYTHON": sys.executable},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    print(run.stdout)
    assert run.returncode == 0 and run.stdout.rstrip().endswith("PASS"), run.stdout
