"""Where the engine's device tensors live: the weights, the paged KV cache and rope tables (in
its `ForwardPass`, worker/forward_pass.py) and the per-request state of each slot
(repetition-penalty token sets, steering vectors, the grammar's matcher), set up from a plan's
`NewRequest`s. Turns a `StepPlan` (worker/plan.py: plain data, no live request) into tensors and
launches the pass (forward, the final hidden states of the rows that get logits, selection,
attribution) without waiting for the GPU; its chosen positions and tokens, then its attribution,
come back as asynchronous device-to-host copies that the engine reads when it needs them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from cde.shared.config import EOS_ID, MASK_ID, PAD_ID, PAGE, ModelConfig
from cde.shared.packed_attribution import PackedAttribution
from cde.worker.attribution_runner import AttributionRunner
from cde.worker.block_attribution import AttributionStash
from cde.worker.carried_picks import Selected, stage_carried
from cde.worker.concept_contributions import head_widths
from cde.worker.constraint import Constraint
from cde.worker.forward_pass import ForwardPass, Items
from cde.worker.lm_head import lm_head_logits
from cde.worker.logit_rules import RequestLogitRules
from cde.worker.logprobs import LogprobsRunner, unpack
from cde.worker.model import SteerlingModel
from cde.worker.plan import NewRequest, Picks, PlannedItem, StepPlan
from cde.worker.sampler import adjust_logits, select_and_sample_adjusted
from cde.worker.staging import HostCopy, Staging, to_host
from cde.worker.steering import SteeringState, alpha_now, prepare_steering
from cde.worker.step_inputs import StepInputBuilder, StepInputs, eligible_rows


@dataclass
class Pass:
    """One launched forward pass and its results on their way to the host."""

    plan: StepPlan
    step_indices: list[int]  # where the step items are in plan.items
    picks: HostCopy | None = None  # [3, S, K]: positions, tokens, valid
    attributed: list[int] = field(default_factory=list)  # step items (indices into step_indices) attributed per step
    attribution: HostCopy | None = None  # [A * K, width] packed rows
    logprob_items: list[int] = field(default_factory=list)  # step items that asked for logprobs
    logprobs: HostCopy | None = None  # [L, K, 1 + 2 * logprob_top] (worker/logprobs.py)
    logprob_top: int = 0
    selected: Selected | None = None  # its positions, tokens and valid [S, K], on the device


class ModelRunner:
    def __init__(
        self,
        model: SteerlingModel,
        cfg: ModelConfig,
        num_pages: int,
        max_running: int,
        cuda_graphs: bool = True,
        kv_splits: int = 0,
        vocab_align: int | None = None,
    ):
        """vocab_align: the LM head's rows are padded to a multiple of it (default 128 on CUDA,
        none elsewhere; the CPU tests pad too, to check that padding never changes a pick)."""
        self.model, self.cfg = model, cfg
        self.forward = ForwardPass(model, cfg, num_pages, max_running, cuda_graphs, kv_splits)
        self.device, self.dtype = self.forward.device, self.forward.dtype
        self.max_running = max_running
        # Tokens each request slot has seen (repetition penalty); the last row takes the writes of
        # selection slots that commit nothing, so the update needs no host-side filtering.
        # The vocabulary (100281) is odd; padded to a multiple of 128 rows the LM head runs on
        # the tensor-core GEMM kernels instead of a slow unaligned fallback. Selection works on
        # the padded width too, with the padding banned: a [:, :V] view of the logits would cost
        # a strided copy of all of them on every step.
        self.lm_head = model.transformer.lm_head.weight
        align = vocab_align or (128 if self.device.type == "cuda" else 1)
        if cfg.vocab_size % align:
            self.lm_head = F.pad(self.lm_head, (0, 0, 0, -cfg.vocab_size % align))
        width = self.lm_head.shape[0]
        self.seen = torch.zeros(max_running + 1, width, dtype=torch.bool, device=self.device)
        # Per slot, set when a request takes it: its steering and its grammar's matcher, if any.
        self.steering: dict[int, SteeringState] = {}
        self.constraints: dict[int, Constraint] = {}
        self.banned = torch.tensor([EOS_ID, MASK_ID, PAD_ID, *range(cfg.token_vocab, width)], device=self.device)
        self.rules = RequestLogitRules(self.device, width, max_running)
        self.step_inputs = StepInputBuilder(self.device, self.banned, self.seen, self.rules, cfg.vocab_size)
        self.attr_inputs = Staging(self.device, torch.int64)
        self.carry_inputs = Staging(self.device, torch.int64)
        self.stash = AttributionStash(max_running, cfg.n_embd, self.dtype, self.device)
        self.logprobs = LogprobsRunner(self.device)
        # The engine's steps run on a stream of the highest priority, so the attribution graphs on
        # their side stream (default priority) fill the SMs a forward pass leaves idle instead of
        # delaying its kernels (a CUDA graph's kernels take the priority of the launching stream).
        self.stream = torch.cuda.Stream(self.device, priority=-100) if self.device.type == "cuda" else None
        self.attribution = AttributionRunner(model, cfg, max_rows=max_running * PAGE)

    # ---- per-request state ------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, new: NewRequest) -> None:
        """A request takes its slot: the slot's state is set up for it (nothing of the last one's stays)."""
        slot, params = new.slot, new.params
        self.seen[slot] = False
        if params.repetition_penalty != 1.0 and new.prompt_ids:
            self.seen[slot, torch.tensor(new.prompt_ids, device=self.device)] = True
        self.rules.start(slot, params)
        self.steering.pop(slot, None)
        if new.steering is not None:
            state = prepare_steering(self.model, self.cfg, new.steering)
            if state.relu_mask is not None:  # to the logits' padded width
                state.relu_mask = F.pad(state.relu_mask, (0, self.seen.shape[1] - state.relu_mask.shape[0]))
            self.steering[slot] = state
        self.constraints.pop(slot, None)
        if new.constraint is not None:
            self.constraints[slot] = new.constraint
        if new.flashblock and self.forward.flashblock_cache is None:
            self.forward.allocate_flashblock_cache()

    @torch.inference_mode()
    def warmup(self, flashblock: bool) -> None:
        """CUDA: compile and capture every forward bucket (and FlashBlock's family when the
        server enables it by default) at startup: the first request of each size would otherwise
        stall every running request for seconds. (The attribution graphs are captured when the
        runner is built.)"""
        if self.forward.graphed is None:
            return
        self.forward.graphed.capture_all()
        self.attribution.capture_all()
        if flashblock:
            self.forward.allocate_flashblock_cache()

    # ---- one forward pass -------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, plan: StepPlan, after: Pass | None = None) -> Pass:
        """Queue a pass (its new requests already started): forward, the final hidden states of
        the rows that get logits (worker/last_block.py), logits, selection and (on a side stream)
        attribution, with their device-to-host copies. Never waits for the GPU, so the engine can
        schedule and launch the next pass while this one's attribution finishes.
        `after`: the pass in flight that `plan` was planned ahead of (worker/plan_ahead.py), whose
        picks complete its items on the device."""
        items = plan.items
        carried = stage_carried(self.carry_inputs, plan, after.selected) if after and after.selected else None
        steer_vec, steer_from = self._steering_inputs(items)
        out = self.forward(items, steer_vec, steer_from, carried)  # first: the GPU starts on it
        steps = [i for i, it in enumerate(items) if it.is_step]
        if not steps:  # no logits read: the pass needs no tail
            return Pass(plan, steps)
        step_items = [items[i] for i in steps]
        relu = [self.steering[it.slot].relu_mask if it.slot in self.steering else None for it in step_items]
        constraints = [self.constraints[it.slot] if it.request.constrained else None for it in step_items]
        inp = self.step_inputs.build(steps, step_items, relu, constraints)
        hidden = self.forward.finish(out, inp.rows)  # [R, D]: row r is logits row r
        sb = inp.sampling
        if carried is not None:
            carried.out_of_grid(sb.grid)
        logits = self._logits(hidden)
        adjusted = adjust_logits(logits, sb)
        positions, chosen, valid = select_and_sample_adjusted(adjusted, sb)
        p = Pass(
            plan,
            steps,
            picks=to_host(torch.stack([positions, chosen, valid.long()])),
            attributed=[n for n, it in enumerate(step_items) if it.request.attribution and it.request.stream_denoise],
            logprob_items=[n for n, it in enumerate(step_items) if it.request.logprobs is not None],
            selected=(positions, chosen, valid),
        )
        if any(it.request.attribution_per_block for it in step_items):
            # attributed when the block completes (worker/block_attribution.py): every pick's row stashed
            lr = sb.grid.gather(1, positions).clamp(min=0)  # [S, K] logits rows
            h = hidden[lr.reshape(-1)]
            keys = self.stash.stage_keys([(it.slot, it.block) for it in step_items])
            self.stash.write(keys, positions, valid, h, chosen, logits[lr.reshape(-1), chosen.reshape(-1)])
        if p.logprob_items:
            p.logprob_top = max(step_items[n].request.logprobs or 0 for n in p.logprob_items)
            p.logprobs = self.logprobs.launch(adjusted, sb.grid, positions, chosen, p.logprob_items, p.logprob_top)
        if p.attributed:
            p.attribution = self._attribute(hidden, p.attributed, logits, sb.grid, positions, chosen)
        self._count_picks(step_items, inp, chosen, valid)  # last: a launch that raises counts nothing
        return p

    def _count_picks(
        self, step_items: list[PlannedItem], inp: StepInputs, chosen: torch.Tensor, valid: torch.Tensor
    ) -> None:
        """The penalties count what a request unmasks. A grammar keeps a prefix of its request's
        picks, which only the host learns (worker/constraint.py): those are counted once placed."""
        sb = inp.sampling
        counted = valid
        constrained = [n for n, it in enumerate(step_items) if it.request.constrained]
        if constrained and (sb.rep_penalty is not None or sb.rules is not None):
            counted = valid.clone()
            counted[constrained] = False
        if sb.rep_penalty is not None:
            slots = torch.where(counted, inp.slots[:, None], self.max_running)
            self.seen[slots, chosen] = True
        self.rules.record(sb.rules, inp.slots, chosen, counted)

    def picks(self, p: Pass) -> list[Picks]:
        """Per step item of the pass: the positions it unmasked and their tokens. Waits for its selection."""
        if not p.step_indices:
            return []
        host = p.picks.tolist()
        picks = [
            Picks([q for q, ok in zip(pos, ok_row) if ok], [t for t, ok in zip(tok, ok_row) if ok])
            for pos, tok, ok_row in zip(*host)
        ]
        if p.logprobs is not None:
            for n, rows in zip(p.logprob_items, p.logprobs.tolist()):
                wanted = p.plan.items[p.step_indices[n]].request.logprobs or 0
                picks[n].logprobs = unpack(rows, p.logprob_top, wanted, host[2][n])
        return picks

    def on_stream(self) -> contextlib.AbstractContextManager:
        """Where the engine runs a step's GPU work: the runner's high-priority stream on CUDA."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # whatever ran outside a step
        return torch.cuda.stream(self.stream)

    @torch.inference_mode()
    def step_logits(self, plan: StepPlan) -> tuple[torch.Tensor, list[int]]:
        """For measurements, not serving (`cde bench engine --flashblock-*` compares FlashBlock's
        reuse with the exact path): the [R, padded vocabulary] logits a pass of `plan` gives every
        eligible position of its step items, and the item (index into plan.items) of each row.
        Nothing is selected, but it is a forward pass like `launch`'s: it writes the items' K/V and
        FlashBlock items read or refresh their cache rows as their modes say."""
        items = plan.items
        steer_vec, steer_from = self._steering_inputs(items)
        out = self.forward(items, steer_vec, steer_from)
        steps = [i for i, it in enumerate(items) if it.is_step]
        rows, _, row_item = eligible_rows(steps, [items[i] for i in steps])
        hidden = self.forward.finish(out, torch.tensor(rows, dtype=torch.int64, device=self.device))
        return self._logits(hidden), [steps[n] for n in row_item]

    def records(self, p: Pass) -> list[PackedAttribution | None]:
        """Per step item of the pass: the attribution of the tokens it committed, packed (None:
        not asked). Waits for the pass's attribution. No Python object per token: the rows are
        sliced as numpy arrays and sent as they are."""
        out: list[PackedAttribution | None] = [None] * len(p.step_indices)
        if not p.attributed:
            return out
        picks = np.asarray(p.picks.tolist())  # [3, S, K], already on the host for picks()
        if p.attribution.ready is not None:
            p.attribution.ready.synchronize()
        rows = p.attribution.host.numpy()  # [A * K, width] float64
        k = picks.shape[2]
        kk, ku = head_widths(self.cfg)
        for a, n in enumerate(p.attributed):
            item = p.plan.items[p.step_indices[n]]
            ok = picks[2, n].astype(bool)
            block_rows = rows[a * k : (a + 1) * k][ok]
            out[n] = PackedAttribution.from_rows(
                block_rows, picks[1, n][ok], item.block * PAGE + picks[0, n][ok], item.step, kk, ku
            )
        return out

    @torch.inference_mode()
    def count_kept(self, kept: list[tuple[int, list[int]]]) -> None:
        """Mark the tokens constrained requests kept ((slot, tokens) each, after their grammar's
        check) as seen and counted, for their penalties in the passes after (see `launch`)."""
        kept = [(slot, tokens) for slot, tokens in kept if tokens]
        if not kept:
            return
        slots = torch.tensor([s for s, tokens in kept for _ in tokens], device=self.device)
        tokens = torch.tensor([t for _, tokens in kept for t in tokens], device=self.device)
        self.seen[slots, tokens] = True
        self.rules.count(slots, tokens)

    @torch.inference_mode()
    def attribute_blocks(self, blocks: list[tuple[int, list[int]]]) -> HostCopy:
        """(stash key, positions within the block) of blocks whose picks the passes stashed ->
        their packed attribution rows, block after block, on their way to the host. Call it before
        the pass after the next is launched (worker/block_attribution.py)."""
        if not any(positions for _, positions in blocks):  # blocks that kept no token
            return HostCopy(torch.empty(0, self.attribution.width, dtype=torch.float64), None)
        return self.attribution.launch(*self.stash.gather(blocks))

    def block_records(
        self, rows: HostCopy, blocks: list[tuple[list[int], list[int], list[int]]]
    ) -> list[PackedAttribution]:
        """`attribute_blocks`' rows with each block's (tokens, absolute positions, commit steps), in
        the same order -> one PackedAttribution per block. Waits for them."""
        if rows.ready is not None:
            rows.ready.synchronize()
        host, start, out = rows.host.numpy(), 0, []
        kk, ku = head_widths(self.cfg)
        for tokens, positions, steps in blocks:
            part = host[start : start + len(tokens)]
            start += len(tokens)
            out.append(
                PackedAttribution.from_rows(part, np.array(tokens), np.array(positions), np.array(steps), kk, ku)
            )
        return out

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, padded vocabulary] logits of the hidden rows [R, D] (the padding columns are banned in selection)."""
        return lm_head_logits(hidden, self.lm_head)

    def _attribute(
        self,
        hidden: torch.Tensor,
        attributed: list,
        logits: torch.Tensor,
        grid: Any,
        positions: torch.Tensor,
        chosen: torch.Tensor,
    ) -> HostCopy:
        """Attribution of every selection slot of the step items that asked (`attributed`), in one
        batched pass: [A * K, width] rows on their way to the host. Slots that commit nothing are
        computed too (static shapes, no sync; on logits row 0) and dropped there."""
        (a,) = self.attr_inputs.stage(attributed)
        pos, tok = positions[a], chosen[a]  # [A, K]
        rows = grid[a].gather(1, pos).clamp(min=0).reshape(-1)  # logits rows, hence hidden rows
        return self.attribution.launch(hidden[rows], tok.reshape(-1), logits[rows, tok.reshape(-1)])

    def _steering_inputs(self, items: Items) -> tuple[torch.Tensor | None, list[int]]:
        """Per item: the vector it injects ([N, D] on the device; None when no item steers, so an
        unsteered pass queues nothing for it) and its first injected layer."""
        vec = None
        start = [self.cfg.n_layers + 1] * len(items)  # past the last layer: no injection
        for i, it in enumerate(items):
            state = self.steering.get(it.slot)
            if it.is_step and state is not None:
                alpha = alpha_now(state, it.committed)
                if alpha != 0.0:
                    if vec is None:
                        vec = torch.zeros(len(items), self.cfg.n_embd, dtype=self.dtype, device=self.device)
                    vec[i] = alpha * state.direction
                    start[i] = min(state.inject_layer, self.cfg.n_layers + 1)
        return vec, start
