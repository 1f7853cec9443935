"""The context limit at its exact boundary: a prompt plus max_tokens that fill the model's context
to the last position run to the end; one token more is refused before anything runs."""

import pytest
from cde.shared.protocol import GenerateRequest
from cde.worker.engine import Engine, EngineArgs

MAX_TOKENS = 70  # over a block boundary: the last block is partly masked past max_tokens


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine(EngineArgs(str(tiny_dir), max_running=1))


def request(engine, spare: int) -> GenerateRequest:
    """A request that leaves `spare` positions of the context unused (negative: over by that many)."""
    prompt = [7] * (engine.cfg.context_len - MAX_TOKENS - spare)
    return GenerateRequest("fit", prompt, max_tokens=MAX_TOKENS, tokens_per_step=32)


def test_a_request_that_fills_the_context_exactly_runs_to_max_tokens(engine):
    assert len(engine.generate([request(engine, 0)])["fit"]) == MAX_TOKENS


def test_one_token_over_the_context_is_refused(engine):
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request(request(engine, -1))
    assert not engine.has_work()
