"""Token selection and sampling, batched over every request that takes a step.

One call handles all step items at once with tensor operations (no Python loop over rows or
logits), so the same code runs on CPU and GPU. Logits arrive only for the rows that matter: the
eligible (still-masked, within max_tokens) positions of every step item, flattened to [R, V]; the
host knows which rows those are, so gathering them costs no device sync. Per request it follows the reference step:
subtract the ReLU steering mask, apply the repetition penalty, ban EOS/mask/pad, take
confidence = max softmax probability over the still-masked positions, unmask the most confident
position(s), and sample their tokens (greedy, temperature + top-k + top-p, or the reference's
entropy-adaptive rule).

Randomness is counter-based: the Gumbel noise of a draw is a hash of (seed, step, position,
token id). A seeded request therefore samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from cde.kernels.row_confidence import row_confidence
from cde.shared.config import PAGE
from cde.worker.constraint import apply_bitmask
from cde.worker.logit_rules import LogitRules, add_item_rows, sync_is_free

_M32 = 0xFFFFFFFF
NEG_INF = float("-inf")


@dataclass
class ReferenceSelection:
    """The step items that unmask a fixed k per step (no confidence threshold, no grammar), which
    select as the reference does: `topk(min(k, n))` over the confidences of their n still-masked
    positions, packed in position order. torch's topk breaks ties by where the values lie in the
    tensor it is given, so that tensor must be the reference's own: ties are common where float32
    softmax saturates at 1.0, and a wider row (or one shared with other requests) picks others."""

    spans: list[tuple[int, int, int]]  # host-side: (step item, still-masked positions n, picks m), m >= 1
    ranks: torch.Tensor  # [P] float32: K - j for an item's j-th pick, so a topk puts the picks first, in order
    items: torch.Tensor  # [P] each pick's step item


@dataclass
class SamplingBatch:
    """Per-row parameters of the S step items (tensors on the logits' device)."""

    grid: torch.Tensor  # [S, 64] int64: row of each eligible position in the logits, -1 elsewhere
    row_item: torch.Tensor  # [R] int64: the step item of each logits row
    n_select: torch.Tensor  # [S] int: tokens_per_step (k) for the row
    threshold: torch.Tensor  # [S] float: confidence threshold, or 2.0 (never) when unset
    temperature: torch.Tensor  # [S] float (0 = greedy)
    top_p: torch.Tensor  # [S] float
    top_k: torch.Tensor  # [S] int (0 = off)
    entropy: torch.Tensor  # [S] bool: reference entropy-adaptive sampling
    seed: torch.Tensor  # [S] int64
    step: torch.Tensor  # [S] int64: the request's step counter (noise stream position)
    banned: torch.Tensor  # [n] int64 token ids never generated
    max_select: int  # host-side bound on selected positions per row (static shape)
    any_sampling: bool  # host-side: some row samples (skip the sort otherwise)
    any_entropy: bool = True  # host-side: some row samples entropy-adaptively (skip its sort otherwise)
    rep_penalty: torch.Tensor | None = None  # [S] float, None when every row has 1.0
    seen: torch.Tensor | None = None  # [S, V] bool: tokens already in the sequence
    rep_rows: torch.Tensor | None = None  # [P] logits rows whose item has a repetition penalty
    relu_mask: torch.Tensor | None = None  # [S, V] float, None when no row has one
    relu_rows: torch.Tensor | None = None  # [Q] logits rows whose item has a ReLU mask
    rules: LogitRules | None = None  # penalties, logit_bias, min_tokens: None when no row has any
    # Constrained decoding (worker/constraint.py), None when no row has a grammar:
    leftmost: torch.Tensor | None = None  # [S] bool: the item unmasks its leftmost positions
    grammar_rows: torch.Tensor | None = None  # [C] logits rows under a grammar's bitmask
    grammar_bitmask: torch.Tensor | None = None  # [C, words] int32: the tokens allowed there
    reference: ReferenceSelection | None = None  # None: every item selects by the batched rule


def adjust_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits [R, V] -> logits after ReLU mask, repetition penalty, the request rules of
    worker/logit_rules.py, bans and grammar bitmasks. Float32 when any of these applies; otherwise the logits
    themselves with the bans written in place (a fresh tensor: no full-vocabulary float32 copy
    per step)."""
    if sb.relu_mask is None and sb.rep_penalty is None and sb.rules is None:
        return _constrain(logits.index_fill_(-1, sb.banned, NEG_INF), sb)
    # A copy (the runner keeps the raw logits: attribution's target logits), then each rule on
    # the rows of the requests that have it: one request's rule does not cost the batch's rows.
    x = logits.to(torch.float32, copy=True)
    if sb.relu_mask is not None and sb.relu_rows is not None:
        add_item_rows(x, sb.relu_rows, sb.row_item, sb.relu_mask, alpha=-1)
    if sb.rep_penalty is not None and sb.seen is not None and sb.rep_rows is not None:
        repetition_penalty(x, sb.rep_rows, sb.row_item[sb.rep_rows], sb.seen, sb.rep_penalty)
    if sb.rules is not None:
        sb.rules.apply(x, sb.row_item)
    return _constrain(x.index_fill_(-1, sb.banned, NEG_INF), sb)


def repetition_penalty(
    x: torch.Tensor,
    rows: torch.Tensor,
    item: torch.Tensor,
    seen: torch.Tensor,
    penalty: torch.Tensor,
    sparse: bool | None = None,
) -> None:
    """The reference's repetition penalty on x's `rows` [P] (of step items `item` [P]), in place:
    a token in the item's `seen` [S, V] has its logit divided by the item's penalty [S] where
    positive, multiplied elsewhere. `sparse` (default: where a sync is free) computes only the seen
    entries, a few hundred of a row's 100k, found once per item (not in a [P, V] copy of its rows);
    the dense form keeps static shapes and no sync. Both give the same bits."""
    if sync_is_free(x, sparse):
        r, token = _seen_pairs(seen, item)
        at = (rows[r], token)
        v, p = x[at], penalty[item[r]]
        x[at] = torch.where(v > 0, v / p, v * p)
    else:
        xr, p = x[rows], penalty[item][:, None]
        x[rows] = torch.where(seen[item], torch.where(xr > 0, xr / p, xr * p), xr)


def _seen_pairs(seen: torch.Tensor, item: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seen[item].nonzero(as_tuple=True) (row, token pairs, row-major) from seen's own nonzero
    entries: each row repeats its item's tokens."""
    pair_item, token = seen.nonzero(as_tuple=True)  # item-major, tokens ascending
    per_item = torch.bincount(pair_item, minlength=seen.shape[0])
    per_row = per_item[item]
    r = torch.repeat_interleave(torch.arange(item.numel(), device=seen.device), per_row)
    row_start = torch.repeat_interleave(per_row.cumsum(0) - per_row, per_row)
    first = (per_item.cumsum(0) - per_item)[item]  # each row's item's first pair
    return r, token[first[r] + torch.arange(r.numel(), device=seen.device) - row_start]


def _constrain(x: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    if sb.grammar_rows is not None and sb.grammar_bitmask is not None:
        apply_bitmask(x, sb.grammar_rows, sb.grammar_bitmask)
    return x


def select_positions(row_conf: torch.Tensor, sb: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """row_conf [R]: each logits row's confidence (the reference's max softmax probability) ->
    (positions [S, K], valid [S, K]) with K = sb.max_select, most confident first. The items of
    `sb.reference` select by the reference's rule; the others (a confidence threshold, a grammar's
    leftmost positions: CDE's own rules) by one topk over the batch's [S, 64] grid."""
    eligible = sb.grid >= 0
    k = min(sb.max_select, PAGE)
    ref = sb.reference
    if ref is not None and len(ref.spans) == eligible.shape[0]:
        positions, wanted = _reference_positions(row_conf, sb.grid, eligible, ref, k), sb.n_select
    else:
        conf = torch.where(eligible, row_conf[sb.grid.clamp(min=0)], -1.0)
        if sb.leftmost is not None:  # constrained items: leftmost first (confidence is never above 1)
            order = 2.0 - torch.arange(conf.shape[1], device=conf.device, dtype=conf.dtype) / conf.shape[1]
            conf = torch.where(sb.leftmost[:, None] & eligible, order[None, :], conf)
        top_conf, positions = conf.topk(k, dim=-1)
        above = (top_conf > sb.threshold[:, None]).sum(-1)
        wanted = torch.where(sb.threshold <= 1.0, above.clamp(min=1), sb.n_select)
        if ref is not None:
            referenced = torch.zeros(eligible.shape[0], 1, dtype=torch.bool, device=eligible.device)
            referenced[ref.items] = True
            positions = torch.where(referenced, _reference_positions(row_conf, sb.grid, eligible, ref, k), positions)
    count = torch.minimum(wanted, eligible.sum(-1))
    valid = torch.arange(k, device=eligible.device)[None, :] < count[:, None]
    return positions, valid


def _reference_positions(
    row_conf: torch.Tensor, grid: torch.Tensor, eligible: torch.Tensor, ref: ReferenceSelection, k: int
) -> torch.Tensor:
    """[S, k] positions: each of `ref`'s items' picks first, in their order, then other positions
    (a row never names a position twice: the carried picks' scatters, worker/carried_picks.py,
    write every slot); the other items' rows are any k positions."""
    # Each item's eligible positions first, in position order (a stable sort), and their
    # confidences packed as the reference packs its still-masked positions.
    order = torch.sort((~eligible).to(torch.int32), dim=1, stable=True).indices
    packed = row_conf[grid.gather(1, order).clamp(min=0)]
    picks = torch.cat([packed[s, :n].topk(m).indices for s, n, m in ref.spans])
    # float32: a topk over 64-bit integers took three times as long (15 us on an H100, on the
    # critical path of a one-request pass); the ranks are small integers, exact in float32.
    rank = torch.zeros(grid.shape, dtype=torch.float32, device=grid.device)
    rank[ref.items, order[ref.items, picks]] = ref.ranks
    return rank.topk(k, dim=-1).indices


def entropy_temperature(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The reference's entropy-adaptive temperature per row: 0.3 + 0.4 * H / log(k_eff)."""
    probs = torch.softmax(logits, -1)
    sorted_probs = probs.sort(-1, descending=True).values
    cum = sorted_probs.cumsum(-1)
    k_eff = ((cum <= top_p[:, None]).sum(-1) + 1).clamp(min=2)
    ent = -(probs * torch.log(probs + 1e-10)).sum(-1)
    return 0.3 + 0.4 * torch.clamp(ent / torch.log(k_eff.to(ent.dtype)), max=1.0)


def filtered_log_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> torch.Tensor:
    """log of the distribution the reference samples from: softmax(logits / T), then top-k
    (CDE extension) and nucleus filtering (keep while cumulative - p <= top_p, first always)."""
    probs = torch.softmax(logits / temperature[:, None], -1)
    sorted_probs, order = probs.sort(-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    # top_p >= 1 keeps everything: a float32 cumsum can overshoot 1.0 and drop the tail.
    keep = ((sorted_probs.cumsum(-1) - sorted_probs) <= top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= (top_k[:, None] <= 0) | (rank < top_k[:, None])
    keep[:, 0] = True
    kept = torch.zeros_like(probs).scatter(-1, order, torch.where(keep, sorted_probs, 0.0))
    return torch.log(kept / kept.sum(-1, keepdim=True))


def sampling_key(seed: int) -> int:
    """A request's 32-bit key for counter_uniform from its 64-bit seed (two's complement: -1 and
    2**64 - 1 are one seed): the low 32 bits, xor the high 32 mixed by murmur3's finalizer (0 stays
    0), so seeds that differ only above bit 31 draw differently and a seed below 2**32 keeps the
    draws it always had."""
    high = (seed >> 32) & _M32
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        high = ((high ^ (high >> shift)) * mul) & _M32
    return (seed ^ high ^ (high >> 16)) & _M32


def counter_uniform(seed: torch.Tensor, stream: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform(0,1) noise [R, V] from a 32-bit integer hash of (seed, stream, token id)."""
    ids = torch.arange(vocab, device=seed.device, dtype=torch.int64)[None, :]
    h = (seed[:, None] * 0x9E3779B1 + stream[:, None] * 0x85EBCA77 + ids * 0xC2B2AE3D) & _M32
    for mul in (0x7FEB352D, 0x846CA68B):
        h = h ^ (h >> 16)
        h = (h * mul) & _M32
    h = h ^ (h >> 16)
    return ((h >> 8).to(torch.float64) + 0.5) / float(1 << 24)


def sample_rows(rows: torch.Tensor, item: torch.Tensor, positions: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """rows [M, V] adjusted logits of selected positions, `item` [M] their step item and
    `positions` [M] their block position -> sampled tokens [M]."""
    top_p, top_k, ent = sb.top_p[item], sb.top_k[item], sb.entropy[item]
    temp = sb.temperature[item].clamp(min=1e-6)
    if sb.any_entropy:
        temp = torch.where(ent, entropy_temperature(rows, top_p), temp)
    logp = filtered_log_probs(rows, temp, top_p, top_k)
    stream = sb.step[item] * PAGE + positions
    gumbel = -torch.log(-torch.log(counter_uniform(sb.seed[item], stream, rows.shape[-1])))
    return (logp.double() + gumbel).argmax(-1)


def select_and_sample(
    logits: torch.Tensor, sb: SamplingBatch, compact: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [R, V] of the eligible rows -> (positions [S, K], tokens [S, K], valid [S, K]).
    `compact` (default: on the CPU) samples only the slots that commit."""
    return select_and_sample_adjusted(adjust_logits(logits, sb), sb, compact)


def select_and_sample_adjusted(
    adjusted: torch.Tensor, sb: SamplingBatch, compact: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """select_and_sample over logits that adjust_logits already processed (the runner keeps
    them for logprobs)."""
    row_conf, row_top = row_confidence(adjusted)
    positions, valid = select_positions(row_conf, sb)
    picked = sb.grid.gather(1, positions).clamp(min=0)  # [S, K] logits rows
    tokens = row_top[picked]  # greedy: each row's argmax, from the same read as its confidence
    if sb.any_sampling:
        rows = adjusted[picked].float()  # [S, K, V]
        s, k = positions.shape
        item = torch.arange(s, device=rows.device)[:, None].expand(s, k)
        is_greedy = ~sb.entropy & ((sb.temperature <= 0) | (sb.top_p <= 0))
        if sync_is_free(rows, compact):
            # Sample only the selected slots that commit (with a confidence threshold K is 64, and
            # sorting 64 vocabularies per step dominated on the CPU).
            slots = (valid & ~is_greedy[:, None]).nonzero(as_tuple=True)
            tokens[slots] = sample_rows(rows[slots], item[slots], positions[slots], sb)
        else:  # static shapes, no sync: every slot is sampled, the greedy rows keep argmax
            sampled = sample_rows(rows.reshape(s * k, -1), item.reshape(-1), positions.reshape(-1), sb).view(s, k)
            tokens = torch.where(is_greedy[:, None], tokens, sampled)
    return positions, tokens, valid
