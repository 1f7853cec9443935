"""Input attribution: which input positions caused each committed token (integrated gradients).

The definition is the official `FaithfulOutputToInputAttributor`'s: for a token committed at
position p in denoising step s, the *snapshot* is what the model saw in that step (the prompt,
every token committed in an earlier step, the rest `<|mask|>`), the target is the token's logit
at p, and the attribution of input position t is integrated gradients from the mask-embedding
baseline with right-Riemann steps:

    C(t) = (E[x_t] - E[mask]) . (1/n) sum_{k=1..n} grad_{e_t} logit(e = E[mask] + k/n (E[x] - E[mask]))

Masked positions get exactly zero (their delta is zero), and so do positions in later blocks
(attention is block-causal), so a target's snapshot stops at the end of its own block.

Unlike the official attributor, steered generations are replayed with the injection the
generation applied in that step: `alpha_now(committed before the step) * direction`, added after
every layer i with i + 1 >= inject_layer at the snapshot's still-masked positions (earlier blocks
are fully committed, so only the target's block is injected, as in the engine's step pass).

The forward is an eager, differentiable full-prefix pass over the engine's own modules
(`worker/model.py`): no KV cache, since the gradient must reach the prompt through every block's
keys and values. Rows of a batch are (target, interpolation step) pairs; `InputAttributionJob`
runs them in chunks of a bounded number of tokens, one chunk per call, so the engine can slice
the work between decoding passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from cde.shared.config import MASK_ID, PAGE
from cde.worker.model import SteerlingModel
from cde.worker.rope import rope_tables
from cde.worker.steering import SteeringState, alpha_now

# Tokens (rows x snapshot length) forwarded and back-propagated at once by default.
DEFAULT_TOKEN_BUDGET = {"cpu": 2048, "cuda": 4096}


@dataclass
class Target:
    """One committed token to explain: its absolute position, token, and the snapshot (ids of
    positions 0 .. end of its block) the model saw when it was committed."""

    position: int
    token_id: int
    snapshot: list[int]
    alpha: float = 0.0  # steering injection strength in the step that committed it


def build_targets(
    prompt_ids: list[int],
    commits: list[tuple[int, int, int]],
    wanted: list[int],
    steering: SteeringState | None = None,
) -> list[Target]:
    """Targets for the positions `wanted`, from the request's commit history `commits`
    ((absolute position, token, step) in commit order, as `Sequence.commits` records it)."""
    by_pos = {pos: (tok, step) for pos, tok, step in commits}
    out = []
    for p in wanted:
        tok, step = by_pos[p]
        end = (p // PAGE + 1) * PAGE
        snap = list(prompt_ids[:end]) + [MASK_ID] * (end - min(len(prompt_ids), end))
        before = [(q, t) for q, t, s in commits if s < step]
        for q, t in before:
            if q < end:
                snap[q] = t
        alpha = alpha_now(steering, len(before)) if steering is not None else 0.0
        out.append(Target(p, tok, snap, alpha))
    return out


def prefix_hidden(
    model: SteerlingModel,
    embeds: torch.Tensor,
    inject: torch.Tensor | None = None,
    inject_from: int | None = None,
) -> torch.Tensor:
    """Final-norm hidden states [R, T, D] of input embeddings [R, T, D] at positions 0..T-1
    (block-causal on absolute 64-token blocks); `inject` [R, T, D] is added after every layer i
    with i + 1 >= inject_from."""
    cfg = model.cfg
    t = embeds.shape[1]
    cos, sin = rope_tables(cfg, t, embeds.device)
    cos, sin = cos[None, None], sin[None, None]
    blocks = torch.arange(t, device=embeds.device) // PAGE
    mask = blocks[:, None] >= blocks[None, :]
    x = embeds
    for i, block in enumerate(model.transformer.blocks):
        x = block.dense(x, cos, sin, mask)
        if inject is not None and inject_from is not None and i + 1 >= inject_from:
            x = x + inject
    return model.transformer.ln_f(x)


@dataclass
class InputAttributionJob:
    """The IG of a list of targets, run chunk by chunk. `attributions[n]` is target n's [T_n]
    vector (positions 0 .. end of its block) once `done`."""

    model: SteerlingModel
    targets: list[Target]
    n_steps: int
    steering: SteeringState | None = None
    token_budget: int | None = None
    attributions: list[torch.Tensor] = field(default_factory=list)
    _next: int = 0  # next (target, step) row, target-major

    def __post_init__(self) -> None:
        if self.n_steps < 1:
            raise ValueError("n_steps must be at least 1")
        dev = next(self.model.parameters()).device
        if self.token_budget is None:
            self.token_budget = DEFAULT_TOKEN_BUDGET.get(dev.type, 2048)
        self.attributions = [torch.zeros(len(t.snapshot), dtype=torch.float32, device=dev) for t in self.targets]

    @property
    def total_rows(self) -> int:
        return len(self.targets) * self.n_steps

    @property
    def done(self) -> bool:
        return self._next >= self.total_rows

    def run(self) -> list[torch.Tensor]:
        """Every remaining chunk at once (tests, offline use)."""
        while not self.done:
            self.step()
        return self.attributions

    def step(self, token_budget: int | None = None) -> bool:
        """Run the next chunk: consecutive rows of targets that share a snapshot length (rows x
        length within the token budget, this call's if given, at least one row). Returns whether
        the job is done."""
        if self.done:
            return True
        first = self._next // self.n_steps
        length = len(self.targets[first].snapshot)
        per_chunk = max(1, (token_budget or self.token_budget) // length)
        rows: list = []
        r = self._next
        while r < self.total_rows and len(rows) < per_chunk and len(self.targets[r // self.n_steps].snapshot) == length:
            rows.append(r)
            r += 1
        self._run_rows(rows)
        self._next = r
        return self.done

    def _run_rows(self, rows: list[int]) -> None:
        model = self.model
        w = model.transformer.lm_head.weight
        dev, dtype = w.device, w.dtype
        tgt = [self.targets[r // self.n_steps] for r in rows]
        ids = torch.tensor([t.snapshot for t in tgt], device=dev)
        alphas = torch.tensor([(r % self.n_steps + 1) / self.n_steps for r in rows], device=dev, dtype=dtype)
        pos = torch.tensor([t.position for t in tgt], device=dev)
        tok = torch.tensor([t.token_id for t in tgt], device=dev)
        inject, inject_from = None, None
        steer = self.steering
        if steer is not None and any(t.alpha != 0.0 for t in tgt):
            vec = torch.stack([t.alpha * steer.direction for t in tgt])  # [R, D], as the runner builds it
            inject = vec[:, None, :] * (ids == MASK_ID)[:, :, None].to(dtype)
            inject_from = steer.inject_layer
        with torch.inference_mode(False), torch.enable_grad():
            with torch.no_grad():
                emb = model.transformer.tok_emb(ids)
                base = model.transformer.tok_emb(torch.tensor([MASK_ID], device=dev))[0]
                delta = emb - base
            interp = (base + alphas[:, None, None] * delta).detach().requires_grad_(True)
            hidden = prefix_hidden(model, interp, inject, inject_from)
            rows_idx = torch.arange(len(rows), device=dev)
            target = (hidden[rows_idx, pos] * w[tok]).sum(-1)  # the token's logit at its position
            (grad,) = torch.autograd.grad(target.sum(), interp)
        contrib = (delta.float() * grad.float()).sum(-1) / self.n_steps  # [R, T]
        for j, r in enumerate(rows):
            self.attributions[r // self.n_steps].add_(contrib[j])


def attribute(
    model: SteerlingModel,
    targets: list[Target],
    n_steps: int,
    steering: SteeringState | None = None,
    token_budget: int | None = None,
) -> list[torch.Tensor]:
    """Per target, its [T] input attribution (blocking)."""
    return InputAttributionJob(model, targets, n_steps, steering, token_budget).run()


def top_inputs(attr: list[float], snapshot: list[int], prompt_len: int, scope: str, k: int) -> list[tuple[int, float]]:
    """The k input positions of largest |contribution| within scope ("prompt": the prompt;
    "all": the prompt and the generated tokens the model saw), as (position, contribution)."""
    limit = prompt_len if scope == "prompt" else len(attr)
    cands = [p for p in range(min(limit, len(attr))) if p < prompt_len or snapshot[p] != MASK_ID]
    cands.sort(key=lambda p: (-abs(attr[p]), p))
    return [(p, attr[p]) for p in cands[:k]]


def aggregate_chunk(
    attrs: list[list[float]], scope_positions: list[int], k: int | None = None
) -> list[tuple[int, float]]:
    """The official `aggregate_chunk` (reduce="mean", signed=True) over the chunk's targets:
    each target's attribution over the scope divided by its absolute mass (at least 1e-8), the
    mean over targets, ranked by the signed score, highest first; (position, score)."""
    if not attrs or not scope_positions:
        return []
    scores = [0.0] * len(scope_positions)
    for a in attrs:
        vals = [a[p] if p < len(a) else 0.0 for p in scope_positions]
        denom = max(math.fsum(abs(v) for v in vals), 1e-8)
        for i, v in enumerate(vals):
            scores[i] += v / denom
    scores = [s / len(attrs) for s in scores]
    order = sorted(range(len(scope_positions)), key=lambda i: -scores[i])
    if k is not None:
        order = order[:k]
    return [(scope_positions[i], scores[i]) for i in order]
