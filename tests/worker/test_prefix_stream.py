"""Token streaming in the engine: PrefixResults against the committed left prefix rebuilt here from
the steps' unmasked positions (`stream_denoise`), on the tiny model."""

from cde.shared.config import PAGE
from cde.shared.protocol import BlockResult, GenerateRequest, PrefixResult, StepResult
from cde.worker.engine import Engine, EngineArgs


def test_prefix_results_are_each_steps_new_committed_left_prefix(tiny_dir):
    prompt = list(range(500, 517))  # 17 tokens: the first block is the prompt's tail block
    engine = Engine(EngineArgs(str(tiny_dir)))
    streamed = GenerateRequest("s", prompt, max_tokens=150, tokens_per_step=3, stream_tokens=True, stream_denoise=True)
    engine.add_request(streamed)
    engine.add_request(GenerateRequest("quiet", prompt, max_tokens=150, tokens_per_step=3))
    results = []
    while engine.has_work():
        results += engine.step()
    assert not any(isinstance(r, PrefixResult) for r in results if r.request_id == "quiet")

    committed: dict[int, int] = {}  # absolute position -> token, of the active block
    sent, prefixes, block_start = 0, 0, len(prompt)
    pending: list[int] = []  # tokens the PrefixResults sent for the active block
    expected: list[int] = []  # what the last step's PrefixResult must say; [] when it must send none
    for r in [r for r in results if r.request_id == "s"]:
        if not isinstance(r, PrefixResult):
            assert expected == [], f"no PrefixResult for {expected}"
        if isinstance(r, StepResult):
            committed.update(zip(r.positions, r.token_ids))
            block_start = max(r.block * PAGE, len(prompt))
            end = min((r.block + 1) * PAGE, len(prompt) + 150)
            n = 0
            while block_start + n < end and block_start + n in committed:
                n += 1
            # What this step's PrefixResult must say (if the block is not complete: the block says it).
            expected = [committed[block_start + i] for i in range(sent, n)] if n < end - block_start else []
            sent = n if expected else sent
        elif isinstance(r, PrefixResult):
            assert r.token_ids == expected != [], (r.token_ids, expected)
            pending += r.token_ids
            prefixes += 1
            expected = []
        else:
            assert isinstance(r, BlockResult)
            assert r.token_ids[: len(pending)] == pending  # the block repeats what was streamed
            committed, sent, pending = {}, 0, []
    assert prefixes > 3
    quiet = [t for r in results if r.request_id == "quiet" and isinstance(r, BlockResult) for t in r.token_ids]
    assert quiet == [t for r in results if r.request_id == "s" and isinstance(r, BlockResult) for t in r.token_ids]
