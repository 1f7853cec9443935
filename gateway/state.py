"""What every route needs: the worker pool, metrics, the served model's name and labels."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from cde.gateway.concepts import ConceptLabels
from cde.gateway.errors import ApiError
from cde.gateway.metrics import Metrics
from cde.gateway.model_info import ModelInfo
from cde.gateway.router import Router


@dataclass
class ServerState:
    router: Router
    served_model_name: str | None = None  # default: the name the workers report
    api_key: str | None = None
    local_labels: ConceptLabels = field(default_factory=ConceptLabels)  # --concept-labels, or the model's
    metrics: Metrics = field(default_factory=Metrics)
    max_model_len: int | None = None  # cap on prompt + generated tokens, below the model's own
    log_requests: bool = False  # prompts and generated text in the logs
    model_root: str | None = None  # the checkpoint served (path or Hub id): model cards' `root`

    @property
    def labels(self) -> ConceptLabels:
        """The gateway's own catalog when it has one, else the one the live model's workers sent."""
        info, catalogs = self.router.model_info, self.router.catalogs
        if len(self.local_labels.catalog) or info is None or catalogs is None:
            return self.local_labels
        return catalogs.labels(info.name, self.router.links)

    @property
    def model_name(self) -> str | None:
        info = self.router.model_info
        return self.api_name(info) if info else None

    def api_name(self, info: ModelInfo) -> str:
        """The name the API gives the model: `--served-model-name`, else the workers' own."""
        return self.served_model_name or info.name

    def model_info(self, requested: str | None) -> ModelInfo:
        """The live model's limits (its context capped by `max_model_len`), after checking the
        request names it; a request that names no model asks for the served one (as vLLM)."""
        info = self.live_info
        if requested is not None and requested != self.api_name(info):
            raise ApiError(404, f"The model `{requested}` does not exist.", "model", "model_not_found")
        return info

    @property
    def live_info(self) -> ModelInfo:
        """The live model's limits, its context capped by `max_model_len`; 503 without a worker."""
        info: ModelInfo = self.router.live()[0].model  # type: ignore[assignment]  # alive: its heartbeat came
        if self.max_model_len is not None and self.max_model_len < info.context_len:
            info = replace(info, context_len=self.max_model_len)
        return info
