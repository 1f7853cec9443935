"""The demo model behind a real `cde serve`, for the API test modules that do not start a server of
their own (a module's own `server`/`client` fixtures take precedence).

One per test process, shared by those modules: none of them changes the server (no flags, no
worker stopped, no counter read), and each start costs seconds of two processes loading."""

import openai
import pytest

from tests.api_server import ServerProcess


@pytest.fixture(scope="session")
def server():
    srv = ServerProcess(None, workers=1)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
