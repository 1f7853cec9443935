"""Logprobs against the official model, float32 CPU, tiny checkpoint written by the official classes.

At temperature 0 every generated token's logprob must be the official model's log-softmax at its
position, over the snapshot the engine committed it from (the prompt, the earlier blocks, and the
block's tokens committed in earlier steps; the rest masked), after the engine's bans (EOS, mask,
pad); its top alternatives are that distribution's best, the chosen token first. The snapshots
come from `stream_denoise` (which positions each step unmasked), the logprobs from the blocks."""

import pytest
import torch
from cde.shared.config import EOS_ID, MASK_ID, PAD_ID, PAGE
from cde.shared.protocol import BlockResult, GenerateRequest, StepResult
from cde.worker.engine import Engine, EngineArgs

from tests.oracle import official_model

pytestmark = [pytest.mark.reference, pytest.mark.slow]

TOP = 5


def _engine_run(model_dir, prompt: list[int], max_tokens: int, per_step: int) -> tuple[list, list]:
    engine = Engine(EngineArgs(str(model_dir)))
    engine.add_request(
        GenerateRequest(
            "lp", prompt, max_tokens=max_tokens, tokens_per_step=per_step, logprobs=TOP, stream_denoise=True
        )
    )
    steps, blocks = [], []
    while engine.has_work():
        for res in engine.step():
            (steps if isinstance(res, StepResult) else blocks).append(res)
    return steps, blocks


def test_logprobs_are_the_official_log_softmax_at_the_committing_step(tiny_official_dir):
    # Two tokens per step: each token's logprob is its own position's, in the step of both.
    prompt = torch.randint(0, 100000, (64,), generator=torch.Generator().manual_seed(7)).tolist()
    max_tokens = 80  # a whole block, then 16 tokens of a block whose other 48 positions stay masked
    steps, blocks = _engine_run(tiny_official_dir, prompt, max_tokens, per_step=2)
    assert all(isinstance(b, BlockResult) and b.logprobs is not None for b in blocks)
    # Per absolute position: the engine's (token, logprob, top ids, top logprobs); blocks are in position order.
    ours, generated = {}, []
    for b in blocks:
        lp = b.logprobs
        for token, row in zip(b.token_ids, zip(lp.logprobs, lp.top_ids, lp.top_logprobs)):
            ours[len(prompt) + len(generated)] = (token, *row)
            generated.append(token)
    assert len(generated) == max_tokens

    # Each step's snapshot: what was committed before it, everything else of its block masked.
    snapshot = prompt + [MASK_ID] * 2 * PAGE
    snapshots = []
    for step in steps:
        snapshots.append(list(snapshot[: (step.block + 1) * PAGE]))
        for pos, token in zip(step.positions, step.token_ids):
            snapshot[pos] = token
    model, raw = official_model(tiny_official_dir)
    banned = [EOS_ID, MASK_ID, PAD_ID, *range(100281, raw["vocab_size"])]
    checked = 0
    for first in range(0, len(steps), 4):  # batched by 4 (a batch shares its length: blocks hold 32 steps)
        batch = [(st, snap) for st, snap in zip(steps[first : first + 4], snapshots[first : first + 4])]
        for length in sorted({len(snap) for _, snap in batch}):
            rows = [(st, snap) for st, snap in batch if len(snap) == length]
            with torch.inference_mode():
                logits = model(torch.tensor([snap for _, snap in rows]), minimal_output=True)[0].double()
                logits[:, :, banned] = float("-inf")
                logp = torch.log_softmax(logits, -1)
            for (step, _), step_logp in zip(rows, logp):
                for pos, token in zip(step.positions, step.token_ids):
                    ref = step_logp[pos]
                    ref_top = ref.topk(TOP)
                    chosen, lp, top_ids, top_lps = ours[pos]
                    assert chosen == token
                    assert abs(lp - ref[token].item()) < 1e-4, (pos, lp, ref[token].item())
                    assert top_ids[0] == token and top_ids == ref_top.indices.tolist()
                    assert max(abs(a - b) for a, b in zip(top_lps, ref_top.values.tolist())) < 1e-4
                    checked += 1
    assert checked == max_tokens
