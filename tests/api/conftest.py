"""Servers shared by the API test modules, one of each per test process (a start costs seconds
of two processes loading): the demo model (`server`) for the modules that do not start one of
their own (a module's own `server`/`client` fixtures take precedence), and the tiny instruct
checkpoint served as "tiny" on one worker (`tiny_chat_server`) for the modules that only send
it requests. No module that uses either changes it: no flags, no worker stopped, no counter read."""

import openai
import pytest

from tests.api_server import ServerProcess


@pytest.fixture(scope="session")
def server():
    srv = ServerProcess(None, workers=1)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tiny_chat_server(tiny_instruct_dir):
    srv = ServerProcess(tiny_instruct_dir, "--served-model-name", "tiny", workers=1)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
