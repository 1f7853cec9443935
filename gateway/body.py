"""The base of every request body model: strict types, unknown fields refused."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Body(BaseModel):
    # Strict: `0` is not `false` and `false` is not a token id. NaN and Infinity (which Python's
    # json accepts, and `1e999` becomes) are never valid numbers.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
