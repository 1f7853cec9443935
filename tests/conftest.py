import importlib.util
import subprocess
import sys

import pytest

from shared.config import preset
from worker.checkpoint import make_model


def pytest_configure(config):
    """Install the official oracle: steerling 0.2.0 declares Python >= 3.13 but its code runs on
    3.11, so it goes in with --no-deps --ignore-requires-python (its runtime deps are in the
    `test` extra)."""
    if importlib.util.find_spec("steerling") is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--ignore-requires-python", "steerling==0.2.0"],
            check=True,
        )


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("tiny"), seed=1)


@pytest.fixture(scope="session")
def tiny_instruct_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("tiny_instruct"), seed=2, instruct=True)


@pytest.fixture(scope="session")
def small_dir(tmp_path_factory):
    return make_model("small", tmp_path_factory.mktemp("small"), seed=3)


@pytest.fixture(scope="session")
def tiny_official_dir(tmp_path_factory):
    from tests.oracle import write_with_official_classes

    return write_with_official_classes(preset("tiny"), tmp_path_factory.mktemp("tiny_official"), seed=4)
