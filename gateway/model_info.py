"""The served model as the gateway's routes see it: its name and what a request must fit (context,
vocabulary, layers, concepts, whether it chats). A worker's `Heartbeat` carries this along with
the worker's own identity and load, which only its link and the metrics read; a gateway route
reads a `ModelInfo`. `cde generate` and training's engine backend, which check requests with the
gateway's rules but have no worker in between, build one from the checkpoint's config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cde.shared.config import ModelConfig
    from cde.shared.protocol import Heartbeat


@dataclass(frozen=True)
class ModelInfo:
    name: str  # as the workers report it (the API's name may differ: --served-model-name)
    context_len: int  # positions: prompt + generated tokens
    vocab_size: int
    instruct: bool  # has the chat template
    n_layers: int
    n_concepts: int  # known concepts; discovered ones follow them in one id space

    @classmethod
    def from_heartbeat(cls, hb: Heartbeat) -> ModelInfo:
        return cls(hb.model, hb.context_len, hb.vocab_size, hb.instruct, hb.n_layers, hb.n_concepts)

    @classmethod
    def from_config(cls, name: str, cfg: ModelConfig) -> ModelInfo:
        return cls(name, cfg.context_len, cfg.vocab_size, cfg.instruct, cfg.n_layers, cfg.n_concepts)
