"""What a worker process runs with, as one typed value: built once by the CLI from its flags and
the environment (cde/commands/settings_builder.py), handed to the engine as is, and sent to a worker
process that `cde serve` starts as one JSON message (`cde worker --settings JSON`), not as flags
rendered again. No torch here: the gateway's process builds it too."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from cde.shared.config import FP8_WEIGHT_ONLY_ROWS
from cde.shared.protocol import FlashBlockSpec

# Input attribution's share of the wall time while other requests decode (worker/input_attribution_runner.py).
INPUT_ATTRIBUTION_SHARE = 0.1


@dataclass(frozen=True)
class EngineArgs:
    model: str
    device: str = "cpu"
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    max_running: int = 16
    max_running_per_client: int | None = None  # slots one client may hold (worker/fair_share.py); None: all
    num_pages: int | None = None  # default: every running request at full context
    max_items: int = 256  # 64-token blocks per forward pass (prefill chunk budget)
    cuda_graphs: bool = True  # CUDA: compiled blocks + one captured graph per batch bucket
    flashblock: FlashBlockSpec | None = None  # default for requests that do not say (None: exact)
    kv_splits: int = 0  # CUDA: split-KV ways at batch 1; 0: chosen per pass (worker/cuda_graphs.py)
    quantization: str = "none"  # "fp8": e4m3 weights for the transformer's linear layers (worker/fp8.py)
    fp8_weight_only_rows: int = FP8_WEIGHT_ONLY_ROWS  # fp8: passes of at most this many rows run weight-only
    prefix_cache: bool = True  # share full prompt pages between requests (worker/prefix_cache.py)
    # Plan each pass before the last one's picks reach the host (worker/plan_ahead.py); None: on CUDA.
    async_scheduling: bool | None = None
    # Input attribution's chunk (tokens forwarded and back-propagated at once; None: the device's
    # default, worker/input_attribution.py) and its share of the time while others decode.
    input_attribution_tokens: int | None = None
    input_attribution_share: float = INPUT_ATTRIBUTION_SHARE


# Seconds a gateway with requests at a worker may send nothing (it Pings twice a second) before
# they are dropped (worker/zmq_server.py).
GATEWAY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class WorkerSettings:
    """One worker process: its engine and how it serves (cde/commands/worker.py's flags)."""

    engine: EngineArgs
    bind: str  # ZeroMQ endpoint
    served_model_name: str | None = None  # None: the model directory's name
    parent_pid: int | None = None  # exit when this process is no longer the parent
    host_workers: int = 1  # CPU: worker processes sharing the host's cores
    threads: int | None = None  # CPU: torch's intra-op threads (None: from the host's cores)
    concept_labels: str | None = None  # the catalog path given (None: found as `cde serve` finds it)
    model_from_hub: bool = False  # the model was a Hub id: its catalog is fetched from the Hub too
    curve_secret_key: str | None = None
    curve_authorized_keys: str | None = None
    gateway_timeout: float = GATEWAY_TIMEOUT_S

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> WorkerSettings:
        """Raise ValueError for text that is not a WorkerSettings' JSON (an unknown or missing
        field). Its sender is the `cde serve` that started this process: values are not re-checked."""
        try:
            raw = json.loads(text)
            engine = raw.pop("engine")
            flashblock = engine.pop("flashblock")
            spec = None if flashblock is None else FlashBlockSpec(**flashblock)
            settings = cls(engine=EngineArgs(**engine, flashblock=spec), **raw)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a worker's settings: {exc}") from None
        return settings
