"""The engine core: `receive -> schedule -> execute -> emit`, one forward pass per `step()`.

Used directly by `cde generate`, the benchmarks and the tests, and wrapped by the ZeroMQ worker.
"""

from __future__ import annotations

import gc
import logging
import random
import threading
import traceback
from dataclasses import dataclass

import torch
from cde.shared.config import PAGE
from cde.shared.grammar import ll_tokenizer
from cde.shared.protocol import BlockResult, EngineResult, GenerateRequest
from cde.shared.request_bounds import check_generate_request
from cde.shared.settings import EngineArgs
from cde.shared.tokenizer import get_tokenizer
from cde.worker import fp8, gemm_tuning, isolation, stream_linear
from cde.worker.checkpoint import DTYPES, load_checkpoint
from cde.worker.constraint import Constraint
from cde.worker.device_clock import DeviceClock
from cde.worker.devices import resolve_device
from cde.worker.gemm_tuning_cache import TuningCache
from cde.worker.input_attribution_runner import InputAttributionRunner
from cde.worker.model_runner import ModelRunner, Pass
from cde.worker.outputs import OutputStage
from cde.worker.plan import StepPlan
from cde.worker.plan_ahead import plan_ahead
from cde.worker.prefix_cache import PrefixCache
from cde.worker.scheduler import Scheduler
from cde.worker.steering import concept_top_tokens

log = logging.getLogger("cde.worker")
REQUEST_FAILED = "engine error on this request (the others in flight go on)"


@dataclass
class EngineStats:
    """The engine's load, as the worker's heartbeat reports it."""

    running: int  # requests being decoded
    waiting: int  # requests queued for pages or a slot
    pages_used: int  # KV cache pages held by running requests
    pages_free: int  # free, or cached and held by no request
    forward_passes: int  # since the engine started
    device_idle_ms: float = 0.0  # of them, the device's waits for the host's next launch (worker/device_clock.py)
    cache_query_tokens: int = 0  # the prefix cache's figures (PrefixCacheStats), since the engine started
    cache_hit_tokens: int = 0
    cache_evictions: int = 0
    cache_pages: int = 0  # pages the prefix cache holds now, referenced or not


class Engine:
    def __init__(self, args: EngineArgs):
        self.args = args
        device = resolve_device(args.device)
        dtype = DTYPES[fp8.engine_dtype(args.dtype, device, args.quantization)]
        fp8.check_quantization(args.quantization, device, dtype)
        self.cfg, model = load_checkpoint(args.model, dtype=dtype, device=device)
        # One request's GEMM configs, each shape's timed over its layers or kept from a run before.
        picks = TuningCache.for_device(torch.device(device)) if device == "cuda" else None
        if args.quantization == "fp8":
            fp8.quantize_model(model, args.fp8_weight_only_rows)
            if picks is not None:
                gemm_tuning.tune_fp8_linears(model, picks)
        elif picks is not None and dtype == torch.bfloat16:  # one request's linears: cuBLAS or Triton, measured
            stream_linear.install(model, cache=picks)
        self.tokenizer = get_tokenizer(self.cfg.instruct)
        num_pages = args.num_pages or args.max_running * self.cfg.max_blocks
        # The K/V of a prompt page depend on its tokens and on the weights as run: model, dtype, quantization.
        namespace = f"{args.model}|{dtype}|{args.quantization}"
        self.scheduler = Scheduler(
            num_pages,
            args.max_running,
            args.max_items,
            self.cfg.eot_id,
            args.max_running_per_client,
            PrefixCache(namespace) if args.prefix_cache else None,
        )
        self.runner = ModelRunner(model, self.cfg, num_pages, args.max_running, args.cuda_graphs, args.kv_splits)
        # Stop strings, attribution records and input attribution (for requests that ask) of each pass.
        inputs = InputAttributionRunner(model, self.cfg, args.input_attribution_tokens, args.input_attribution_share)
        self.outputs = OutputStage(self.scheduler, self.tokenizer, inputs)
        if device == "cuda":
            # llguidance's token tables (~0.7 s, once per process) are built beside the warm-up, not
            # in the step of the first constrained request, where they stalled every request (the
            # H200's constrained first block: 1.07 s against 0.39). The CPU tests' many short-lived
            # workers would each pay them for nothing.
            threading.Thread(target=ll_tokenizer, args=(self.cfg.instruct, self.cfg.vocab_size), daemon=True).start()
        # CUDA: every graph bucket is captured now, not when the first request of its size stalls the others.
        self.runner.warmup(flashblock=args.flashblock is not None)
        # Loading and compiling leave ~10^6 long-lived Python objects that a full collection would
        # scan on every run: ~0.2 s per collection with a single small compiled function on the CPU, paid
        # inside whatever step triggers it. Frozen, they are never scanned again.
        gc.collect()
        gc.freeze()
        self.forward_passes = 0
        self.passes_planned_ahead = 0  # of them
        self.device_clock = DeviceClock(device == "cuda")
        # On the CPU a launch computes its pass at once: planned ahead, every result would only
        # wait a pass longer.
        self.plans_ahead = device == "cuda" if args.async_scheduling is None else args.async_scheduling
        self._in_flight: Pass | None = None  # launched by the last step(), finished by the next
        self._after_next: Pass | None = None  # launched by the last step() too, ahead of _in_flight
        self._failed: list[BlockResult] = []  # requests failed alone since the last step() returned

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, req: GenerateRequest) -> None:
        """Raise LimitError (a ValueError) for a request the engine cannot run, checked by the
        rules the gateway checks too, before the server's defaults fill in (the flags have their
        own check); else queue it."""
        check_generate_request(req, self.cfg, input_attribution=self.args.quantization != "fp8")
        # Until its last result is out, a second request under its id would share its pages and
        # results (and its sender would get the first one's end).
        if self.scheduler.in_flight(req.request_id) or self.outputs.holds(req.request_id):
            raise ValueError(f"request id {req.request_id[:100]!r} is already in flight")
        if req.flashblock is None:
            req.flashblock = self.args.flashblock
        if req.seed is None:
            req.seed = random.getrandbits(32)
        # Built before the request queues: a grammar the worker cannot use refuses it alone.
        constraint = Constraint(req.grammar, self.cfg.instruct, self.cfg.vocab_size) if req.grammar else None
        seq = self.scheduler.add(req, constraint)
        try:
            self.outputs.track(seq)
        except BaseException:  # refused whole: not left queued with no output stage behind it
            self.abort(req.request_id)
            raise

    def abort(self, request_id: str) -> bool:
        dropped = self.outputs.abort(request_id)
        return self.scheduler.abort(request_id) or dropped

    def has_work(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_work() or self.outputs.has_work()

    def concept_top_tokens(self, concept_id: int, k: int) -> tuple[list[int], list[float]]:
        """Raise ValueError for an id or k the model cannot answer (the gateway checks the same)."""
        if not 0 <= concept_id < self.cfg.n_concepts:
            raise ValueError(f"unknown concept id {concept_id}")
        if not 1 <= k <= self.cfg.vocab_size:
            raise ValueError(f"k must be in [1, {self.cfg.vocab_size}]")
        return concept_top_tokens(self.runner.model, concept_id, k)

    # ---- one iteration ----------------------------------------------------------------------
    def step(self) -> list[EngineResult]:
        """Finish one forward pass: the blocks it completed, preceded by the step events of
        requests with `stream_denoise`.

        Pipelined: on CUDA the next pass is planned and launched before this one's picks are
        read (worker/plan_ahead.py), so the GPU goes from one pass to the next without waiting for
        the host; where it cannot be, it is planned and launched as soon as the picks are placed.
        Only then does the output stage finish this pass's results: stop strings, and the
        attribution that ran on a side stream. When that means waiting for completed blocks'
        attribution, the pass after the next one is launched first, so two passes are queued."""
        try:
            with self.runner.on_stream():
                results = self._step()
        finally:  # a step that raises fails every request (the worker's answer): none stays due later
            failed, self._failed = self._failed, []
        if not failed:
            return results
        # A request whose block ended it (a stop string found once the next pass, which then failed
        # for it, was launched) has its end already.
        ended = {r.request_id for r in results if isinstance(r, BlockResult) and r.finished}
        # A failed request's last block, if it sent one, before its end.
        return [*results, *(f for f in failed if f.request_id not in ended)]

    def _step(self) -> list[EngineResult]:
        current = self._in_flight or self._launch()
        # Taken off before it is read: a pass whose reading raises is dropped with the requests
        # the worker then fails, instead of being read (and failing) again at every later step.
        self._in_flight = None
        if current is None:
            return self.outputs.idle()
        ahead, self._after_next = self._after_next, None
        if ahead is None and self.plans_ahead:
            ahead = self._launch_ahead(current)
        picks = self.runner.picks(current)
        # Unless the next pass went ahead, from here to its launch the GPU waits for the host: a
        # garbage collection landing here (a full one scans every attribution record held) would
        # stall it. The collection runs instead at the first allocation after it, while the GPU
        # computes.
        collecting = gc.isenabled()
        gc.disable()
        try:
            placed = self.scheduler.place(current.plan, picks)
            self.runner.count_kept(self.scheduler.kept_by_grammars(current.plan, picks))
            if ahead is not None:
                self.scheduler.launched_ahead(ahead.plan)
            self.forward_passes += 1
            self.outputs.attribute_blocks(current.plan, placed, self.runner)
            self._in_flight = ahead or self._launch()
            if self._in_flight is None:
                self.device_clock.pause()
            elif self.plans_ahead and self.outputs.waits_for_blocks():
                # The output stage is about to wait for completed blocks' attribution, which runs
                # on the side stream beside the pass in flight, and then to pack it (and the worker
                # to send it): for 32 blocks that outlasts the pass, so the one after it goes now.
                self._after_next = self._launch_ahead(self._in_flight)
        finally:
            if collecting:
                gc.enable()
        return self.outputs.finish(placed, self.runner.records(current))

    def _launch_ahead(self, current: Pass) -> Pass | None:
        """The pass after `current` (in flight), planned and launched before current's picks are
        read; None when it must wait for them. A launch that raises is dropped: the pass is
        planned again (at the latest after the picks, where a request that makes it fail is failed
        alone: `_launch`)."""
        plan = plan_ahead(self.scheduler, current.plan)
        if plan is None:
            return None
        try:
            ahead = self._timed_launch(plan, after=current)
        except Exception:
            log.warning("a pass planned ahead failed to launch; planned again:\n%s", traceback.format_exc())
            return None
        self.passes_planned_ahead += 1
        return ahead

    def _launch(self) -> Pass | None:
        """The next pass, launched. A request whose own setup or values make it fail is dropped
        from it and failed alone (worker/isolation.py); a failure no single request explains
        propagates, and the worker fails every request in flight."""
        plan = self.scheduler.schedule()
        failed = set()
        for new in plan.new:
            try:
                self.runner.start(new)
            except Exception:
                log.error("request %s fails its setup:\n%s", new.params.request_id[:100], traceback.format_exc())
                failed.add(new.slot)
        plan = plan.without(failed)
        while True:
            for slot in failed:
                self._fail(slot)
            if not plan.items:
                return None
            try:
                return self._timed_launch(plan)
            except Exception:
                failed = isolation.culprits(self.runner, plan)
                if not failed:
                    raise
                plan = plan.without(failed)

    def _timed_launch(self, plan: StepPlan, after: Pass | None = None) -> Pass:
        self.device_clock.launching()
        launched = self.runner.launch(plan, after)
        self.device_clock.launched()
        for slot, constraint in self.runner.constraints.items():
            if constraint.too_slow:  # one such mask was paid; no request waits on another
                self._fail(slot, constraint.too_slow)
        return launched

    def _fail(self, slot: int, error: str = REQUEST_FAILED) -> None:
        """End the request in the slot with an error, at once, leaving the others to run."""
        seq = self.scheduler.running_in(slot)
        if seq is None:
            return
        self.outputs.abort(seq.id)
        if self.scheduler.end(seq, "error"):
            self._failed.append(
                BlockResult(
                    seq.id,
                    [],
                    True,
                    "error",
                    error=error,
                    prompt_tokens=seq.prompt_len,
                    cached_tokens=seq.cached_pages * PAGE,
                )
            )

    def generate(self, requests: list[GenerateRequest]) -> dict[str, list[int]]:
        """Run requests to completion; returns the generated token ids of each."""
        out: dict[str, list[int]] = {r.request_id: [] for r in requests}
        for r in requests:
            self.add_request(r)
        while self.has_work():
            for res in self.step():
                if isinstance(res, BlockResult):
                    out[res.request_id].extend(res.token_ids)
        return out

    def stats(self) -> EngineStats:
        s, cache = self.scheduler, self.scheduler.prefix_cache
        stats = EngineStats(
            running=len(s.running),
            waiting=len(s.waiting),
            pages_used=s.pages.num_used,
            pages_free=s.pages.num_free,
            forward_passes=self.forward_passes,
            device_idle_ms=self.device_clock.idle_ms(),
        )
        if cache is not None:
            stats.cache_query_tokens, stats.cache_hit_tokens = cache.stats.query_tokens, cache.stats.hit_tokens
            stats.cache_evictions, stats.cache_pages = cache.stats.evictions, cache.pages_held
        return stats
