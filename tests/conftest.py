import importlib.util
import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (tests/kernels/test_triton_interpreted.py).
# Triton reads the variable when a kernel is defined, so it is set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cde.shared.config import preset
from cde.worker.checkpoint import make_model
from cde.worker.cpu_threads import use_huge_pages

# As the CLI does, for the engines the tests run in this process (and the servers they start):
# torch reads the switch at its first large CPU allocation, which no import makes.
use_huge_pages()


def pytest_configure(config):
    """The official oracle is installed by the install step (.ci/run); without it the parity tests
    cannot mean anything, so say how to get it rather than fail in each of them."""
    if importlib.util.find_spec("steerling") is None:
        raise pytest.UsageError(
            "the official steerling package (the tests' oracle) is not installed: "
            "pip install --no-deps --ignore-requires-python steerling==0.2.0 (see .ci/run)"
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
