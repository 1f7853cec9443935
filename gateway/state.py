"""What every route needs: the worker pool, metrics, the served model's name and labels."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from gateway.concepts import ConceptLabels
from gateway.errors import ApiError
from gateway.metrics import Metrics
from gateway.router import Router
from shared.protocol import Heartbeat


@dataclass
class ServerState:
    router: Router
    served_model_name: str | None = None  # default: the name the workers report
    api_key: str | None = None
    labels: ConceptLabels = field(default_factory=ConceptLabels)
    metrics: Metrics = field(default_factory=Metrics)

    @property
    def model_name(self) -> str | None:
        info = self.router.info
        return self.served_model_name or (info.model if info else None)

    def model_info(self, requested: str) -> Heartbeat:
        """The live model's limits, after checking the request names it."""
        info = self.router.info
        if info is None:
            raise ApiError(503, "no worker is available", code="no_worker")
        if requested != self.model_name:
            raise ApiError(404, f"The model `{requested}` does not exist.", "model", "model_not_found")
        return info

    def authorized(self, header: str | None) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())
