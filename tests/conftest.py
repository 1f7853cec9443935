import pytest

from shared.config import preset
from worker.checkpoint import make_model


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
