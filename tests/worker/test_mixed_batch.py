"""Twelve concurrent requests mixing steering (different concepts, inject layers, schedules, ReLU
masks), attribution and plain decoding give exactly what each gives alone: steering vectors and
attribution are per request inside the one batched pass, never leaking across rows."""

import copy

import numpy as np
import torch
from cde.shared.protocol import AttributionSpec, GenerateRequest, SteeringSpec
from cde.worker.engine import Engine, EngineArgs


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 100000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def requests() -> list[GenerateRequest]:
    amplify = SteeringSpec([3, 17], strength=8.0, inject_layer=1, schedule="hard_cutoff", cutoff_tokens=4)
    fixed = SteeringSpec([5], strength=6.0, inject_layer=2, schedule="fixed")
    suppress = SteeringSpec(
        [7, 11], strength=-7.0, normalize=False, inject_layer=1, schedule="fixed", relu_logit_mask={7: 20.0}
    )
    attr = AttributionSpec()
    specs = [
        {"steering": amplify},
        {"steering": fixed, "attribution": attr},
        {"steering": suppress},
        {"steering": suppress, "attribution": attr, "tokens_per_step": 2},
        {"attribution": attr},
        {"attribution": attr, "tokens_per_step": 3},
        {},
        {"tokens_per_step": 2},
        {"steering": amplify, "temperature": 0.8, "top_p": 0.9, "seed": 5},
        {"attribution": attr, "entropy_sampling": True, "top_p": 0.8, "seed": 6},
        {"steering": fixed},
        {},
    ]
    lengths = [64, 128, 120, 64, 70, 128, 64, 130, 64, 64, 128, 60]  # 120 and 60 cross a block
    max_tokens = [12, 10, 16, 12, 8, 16, 8, 12, 10, 10, 9, 14]
    return [
        GenerateRequest(f"r{i}", prompt(n, i), max_tokens=m, **kw)
        for i, (kw, n, m) in enumerate(zip(specs, lengths, max_tokens))
    ]


def assert_same_attribution(mixed: list[dict], alone: list[dict], rtol: float = 1e-6) -> None:
    """Same tokens, positions, steps and concepts; the values agree to float32 rounding only,
    since a matrix product's rounding depends on how many rows share it."""
    assert [(r["token_id"], r["position"], r["step"]) for r in mixed] == [
        (r["token_id"], r["position"], r["step"]) for r in alone
    ]
    for a, b in zip(mixed, alone):
        for kind in ("known", "discovered"):
            assert [c[0] for c in a[kind]] == [c[0] for c in b[kind]]
            np.testing.assert_allclose(np.array(a[kind])[:, 1:], np.array(b[kind])[:, 1:], rtol=rtol, atol=1e-7)
        np.testing.assert_allclose(
            [a["target_logit"], a["epsilon"]], [b["target_logit"], b["epsilon"]], rtol=rtol, atol=1e-7
        )


def run(engine: Engine, reqs: list[GenerateRequest], stagger: bool) -> dict[str, tuple]:
    """Tokens and attribution records per request; with stagger, requests join at different steps."""
    out = {r.request_id: ([], []) for r in reqs}
    pending = list(reqs)
    while pending or engine.has_work():
        for _ in range(2 if stagger else len(pending)):
            if pending:
                engine.add_request(copy.deepcopy(pending.pop(0)))
        for res in engine.step():
            out[res.request_id][0].extend(res.token_ids)
            out[res.request_id][1].extend(res.attribution or [])
    return out


def test_mixed_batch_equals_each_alone(tiny_dir):
    engine = Engine(EngineArgs(str(tiny_dir)))
    reqs = requests()
    mixed = run(engine, reqs, stagger=True)
    for r in reqs:
        alone = run(engine, [r], stagger=False)[r.request_id]
        assert mixed[r.request_id][0] == alone[0], r.request_id
        assert_same_attribution(mixed[r.request_id][1], alone[1])
        assert len(alone[0]) == r.max_tokens
        assert len(alone[1]) == (r.max_tokens if r.attribution else 0)
