"""The `suppress` steering preset's values (the official generator's), in one place: the gateway
builds a request's SteeringSpec from them, and `cde eval`'s faithfulness measure applies the same
suppression to the dense forward."""

from __future__ import annotations

STRENGTH = -7.0  # injected along the unit concept embedding, not normalised to logit units
RELU_MASK = 20.0  # the token logits lose RELU_MASK * relu(E_c . W_vocab)
CUTOFF_TOKENS = 32


def inject_layer(n_layers: int) -> int:
    """Injected after every layer i with i + 1 >= this (presets are tuned for the 32-layer 8B)."""
    return n_layers // 2
