"""The tokens the sampler draws follow the distribution they should: a chi-square goodness-of-fit
test of many seeded draws against the filtered distribution, for temperature + top-p, top-k and
entropy-adaptive sampling. The expected distribution comes from the official package's
`_sample_token` (the probabilities it hands to its nucleus sampler) where it has the mode, and
from a few lines of plain softmax arithmetic for top-k, which it lacks.

test_sampler.py checks the sampler's filtered log-probabilities; only a test of the draws
themselves catches noise of the wrong scale (a Gumbel draw scaled by 0.7 samples at 0.7x the
temperature) or noise that is not uniform across seeds.

The last test draws through the whole engine (request parameters staged to the device, the
model's own logits) and compares with the official model's distribution at the same position.

False alarms: each check rejects at p < ALPHA = 1e-4, so a correct sampler fails one of the ten
checks here with probability below 0.1% for a random choice of seeds. The seeds are fixed, so a
given tree passes or fails deterministically.
"""

import pytest
import torch
from cde.shared.config import EOS_ID, MASK_ID, PAD_ID
from cde.shared.protocol import GenerateRequest
from cde.worker.engine import Engine, EngineArgs
from cde.worker.sampler import SamplingBatch, select_and_sample

ALPHA = 1e-4
DRAWS = 10_000
VOCAB = 256


def logits(case: str) -> torch.Tensor:
    g = torch.Generator().manual_seed({"spread": 1, "peaked": 2}[case])
    x = torch.randn(VOCAB, generator=g) * (1.5 if case == "spread" else 3.0)
    if case == "peaked":
        x[7] += 4.0
    return x


def draw(row: torch.Tensor, compact: bool = True, **params) -> torch.Tensor:
    """DRAWS tokens from one logits row: DRAWS step items with one eligible position each and
    their own seeds, through the engine's selection and sampling entry point."""
    s = DRAWS
    grid = torch.full((s, 64), -1)
    grid[:, 5] = torch.arange(s)
    full = lambda v, dtype=torch.float32: torch.full((s,), v, dtype=dtype)
    sb = SamplingBatch(
        grid=grid,
        row_item=torch.arange(s),
        n_select=full(1, torch.int64),
        threshold=full(2.0),
        temperature=full(params.get("temperature", 1.0)),
        top_p=full(params.get("top_p", 1.0)),
        top_k=full(params.get("top_k", 0), torch.int64),
        entropy=full(params.get("entropy", False), torch.bool),
        seed=torch.arange(s, dtype=torch.int64) + 1000,
        step=full(3, torch.int64),
        banned=torch.tensor([VOCAB - 1]),
        max_select=1,
        any_sampling=True,
    )
    positions, tokens, valid = select_and_sample(row.expand(s, VOCAB).clone(), sb, compact=compact)
    assert valid.all() and (positions == 5).all()
    return tokens[:, 0]


def official_filtered(monkeypatch, row: torch.Tensor, **gen_kwargs) -> torch.Tensor:
    """The distribution the official `_sample_token` draws from for this row, in vocabulary
    order: the probabilities it passes to `_sample_top_p`, nucleus-filtered by its own rule."""
    import steerling.inference.causal_diffusion as ref
    from steerling.configs.generation import GenerationConfig

    seen = []
    monkeypatch.setattr(
        ref, "_sample_top_p", lambda probs, top_p, generator=None: seen.append((probs, top_p)) or torch.zeros(1)
    )
    ref._sample_token(row, GenerationConfig(**gen_kwargs))
    ((probs, top_p),) = seen
    sorted_probs, order = probs.double().sort(descending=True)
    keep = (torch.cumsum(sorted_probs, -1) - sorted_probs) <= top_p
    keep[0] = True
    kept = torch.where(keep, sorted_probs, 0.0)
    return torch.zeros_like(kept).scatter(0, order, kept / kept.sum())


def top_k_filtered(row: torch.Tensor, temperature: float, k: int) -> torch.Tensor:
    probs = torch.softmax(row.double() / temperature, -1)
    top = probs.topk(k)
    return torch.zeros_like(probs).scatter(0, top.indices, top.values / top.values.sum())


def chi_square_p(tokens: torch.Tensor, expected: torch.Tensor, min_bins: int = 5) -> float:
    """p-value of the draws under `expected`. Tokens expected fewer than 5 times are pooled into
    one bin (the test's approximation needs >= 5 per bin); the survival function of the
    chi-square distribution is the regularized upper incomplete gamma."""
    counts = torch.bincount(tokens, minlength=expected.shape[0]).double()
    assert counts[expected == 0].sum() == 0, "drew tokens the filter removes"
    want = expected * tokens.shape[0]
    big = want >= 5
    obs = torch.cat([counts[big], counts[~big & (expected > 0)].sum()[None]])
    exp = torch.cat([want[big], want[~big & (expected > 0)].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    assert len(exp) >= min_bins, "too few bins: the case cannot tell distributions apart"
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(len(exp) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


CASES = {
    "t0.7-p0.8": ("spread", dict(temperature=0.7, top_p=0.8)),
    "t1.2-p0.95": ("peaked", dict(temperature=1.2, top_p=0.95)),
    "t1.0-p1.0": ("spread", dict(temperature=1.0, top_p=1.0)),
    "t0.5-p1.0": ("spread", dict(temperature=0.5, top_p=1.0)),
    "topk10-t1.0": ("spread", dict(temperature=1.0, top_k=10)),
    "topk40-t0.8": ("peaked", dict(temperature=0.8, top_k=40)),
    "entropy-p0.8": ("spread", dict(entropy=True, top_p=0.8)),
    "entropy-p0.95": ("peaked", dict(entropy=True, top_p=0.95)),
}


def expected_distribution(monkeypatch, row, params) -> torch.Tensor:
    if params.get("top_k"):
        return top_k_filtered(row, params["temperature"], params["top_k"])
    if params.get("entropy"):
        return official_filtered(monkeypatch, row, use_entropy_sampling=True, top_p=params["top_p"])
    return official_filtered(
        monkeypatch, row, use_entropy_sampling=False, temperature=params["temperature"], top_p=params["top_p"]
    )


@pytest.mark.parametrize("name", list(CASES))
def test_draws_follow_the_filtered_distribution(monkeypatch, name):
    case, params = CASES[name]
    row = logits(case)
    row[VOCAB - 1] = row.max() + 5  # banned: never drawn, and left out of the expected distribution
    expected = expected_distribution(monkeypatch, row[: VOCAB - 1], params)
    expected = torch.cat([expected, torch.zeros(1, dtype=expected.dtype)])
    tokens = draw(row, **params)
    assert chi_square_p(tokens, expected) > ALPHA


def test_static_shape_path_draws_the_same_tokens():
    """The GPU path (every slot sampled, no host sync) draws exactly the CPU path's tokens, so
    the statistics above hold for it too."""
    row = logits("spread")
    params = dict(temperature=0.9, top_p=0.9, top_k=50)
    assert torch.equal(draw(row, compact=True, **params), draw(row, compact=False, **params))


def test_the_test_rejects_a_sampler_at_the_wrong_temperature(monkeypatch):
    """Power check: draws at temperature 0.7 are rejected as draws at 1.0 (the very bug the
    chi-square test exists to catch), with a p-value far below ALPHA."""
    row = logits("spread")
    tokens = draw(row, temperature=0.7, top_p=1.0)
    expected = official_filtered(monkeypatch, row, use_entropy_sampling=False, temperature=1.0, top_p=1.0)
    assert chi_square_p(tokens, expected) < ALPHA * 1e-6


def test_engine_draws_follow_the_official_models_distribution(tiny_dir, monkeypatch):
    """Requests of one 64-token prompt and max_tokens 1 sample position 64 (the only one they
    may unmask) with their own seeds, through the engine's real path from request fields to the
    sampler. Expected: the official model's logits there, EOS, mask and pad banned, then
    temperature and top-k, or the official entropy-adaptive rule (which ignores the temperature:
    a request that lost its entropy flag would sample far outside the official nucleus). Few
    draws (each sorts the 100k vocabulary on the CPU), enough for wiring bugs: a field dropped or
    swapped changes the distribution wholesale."""
    from tests.oracle import official_generator

    prompt = torch.randint(0, 100000, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        row = official_generator(tiny_dir)._forward(torch.tensor([prompt + [MASK_ID] * 64]))[0, 64]
        row[[EOS_ID, MASK_ID, PAD_ID]] = float("-inf")
    cases = {
        "top-k": (dict(temperature=2.0, top_k=8), top_k_filtered(row, 2.0, 8), 256),
        "entropy": (
            dict(temperature=2.0, entropy_sampling=True, top_p=0.95),
            official_filtered(monkeypatch, row, use_entropy_sampling=True, top_p=0.95),
            64,
        ),
    }
    engine = Engine(EngineArgs(str(tiny_dir), max_running=320))
    out = engine.generate(
        [
            GenerateRequest(f"{name}{i}", prompt, max_tokens=1, seed=i, **params)
            for name, (params, _, n) in cases.items()
            for i in range(n)
        ]
    )
    for name, (_, expected, n) in cases.items():
        tokens = torch.tensor([out[f"{name}{i}"][0] for i in range(n)])
        assert chi_square_p(tokens, expected, min_bins=2) > ALPHA, name
