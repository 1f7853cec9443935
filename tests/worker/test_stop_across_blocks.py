"""Stops at a block's edges, checked in the worker itself: the gateway cuts the text again, so a
worker that misses a stop is seen only in what it wastes and reports (the tokens it goes on to
generate, `finish_reason`, `return_token_ids`). The expected cut is found in the test by plain
string search over the decoded tokens of the same request run without a stop (a seeded sample:
varied text, and identical up to the stop)."""

import pytest
from cde.shared.config import PAGE
from cde.shared.protocol import GenerateRequest
from cde.worker.engine import Engine, EngineArgs

PROMPT = list(range(1000, 1000 + PAGE))  # one full block: generated token i sits in block 1 + i // 64
SAMPLED = {"max_tokens": 3 * PAGE, "temperature": 1.0, "seed": 0, "tokens_per_step": 32}


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine(EngineArgs(str(tiny_dir), max_running=2))


@pytest.fixture(scope="module")
def unstopped(engine):
    return engine.generate([GenerateRequest("free", PROMPT, **SAMPLED)])["free"]


def run(engine, **stops):
    results = []
    engine.add_request(GenerateRequest("stopped", PROMPT, **SAMPLED, **stops))
    while engine.has_work():
        results += engine.step()
    return [t for r in results for t in r.token_ids], results[-1]


def test_a_stop_string_across_a_block_boundary_ends_the_request_in_that_block(engine, unstopped):
    decode = engine.tokenizer.decode
    first_block, text = decode(unstopped[:PAGE]), decode(unstopped)
    assert text.startswith(first_block)
    edge = len(first_block)
    # The shortest string around the edge that occurs nowhere else: only the two blocks together hold it.
    stop = next(s for w in range(1, 8) if text.count(s := text[edge - w : edge + w]) == 1)
    assert stop not in first_block and stop not in decode(unstopped[PAGE:])
    cut = next(n for n in range(len(unstopped) + 1) if stop in decode(unstopped[:n]))
    assert PAGE < cut <= 2 * PAGE
    tokens, last = run(engine, stop=[stop])
    assert tokens == unstopped[:cut]
    assert (last.finish_reason, last.stop_str) == ("stop", stop)


@pytest.mark.parametrize("position", [PAGE - 1, PAGE])  # the last token of a block, the first of the next
def test_a_stop_token_at_a_block_edge_cuts_there(engine, unstopped, position):
    stop_id = unstopped[position]
    assert stop_id not in unstopped[:position]
    tokens, last = run(engine, stop_token_ids=[stop_id])
    assert tokens == unstopped[:position]
    assert last.finish_reason == "stop"
