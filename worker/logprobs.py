"""Logprobs of the committed tokens, for the requests that ask, batched on the device.

Definition (docs/api.md): a generated token's logprob is log_softmax, over the vocabulary, of the
logits at its position in the pass that committed it, as the engine processed them before
sampling (steering's ReLU mask, repetition penalty, and the bans of EOS, mask and pad), and
before temperature, top-k and top-p. The top alternatives are that distribution's best entries,
so at temperature 0 the chosen token is the first of them.

Only the selection slots of the step items that asked are computed, in one batched pass with one
device-to-host copy; a pass where nobody asked does none of it."""

from __future__ import annotations

import torch
from cde.worker.staging import HostCopy, Staging, to_host

# One token's logprobs on the host: (logprob, top ids, top logprobs).
TokenRow = tuple[float, list[int], list[float]]


class LogprobsRunner:
    def __init__(self, device: torch.device) -> None:
        self.inputs = Staging(device, torch.int64)

    def launch(
        self,
        adjusted: torch.Tensor,
        grid: torch.Tensor,
        positions: torch.Tensor,
        tokens: torch.Tensor,
        items: list[int],
        n_top: int,
    ) -> HostCopy:
        """adjusted [R, V] logits (sampler.adjust_logits), grid [S, 64], positions and tokens
        [S, K] of the pass; `items`: the step items that asked; n_top: the most alternatives any
        of them asked for. -> [A, K, 1 + 2 n_top] float32 on its way to the host: per selection
        slot the chosen token's logprob, the top logprobs, then the top ids (exact in float32:
        vocabularies are far below 2^24)."""
        (a,) = self.inputs.stage(items)
        pos = positions[a]
        rows = adjusted[grid[a].gather(1, pos).clamp(min=0)].float()  # [A, K, V]
        logp = torch.log_softmax(rows, -1)
        chosen = logp.gather(-1, tokens[a][..., None])
        top = logp.topk(n_top, -1)
        return to_host(torch.cat([chosen, top.values, top.indices.float()], -1))


def unpack(host: list, n_top: int, wanted: int, valid: list[bool]) -> list[TokenRow]:
    """One step item's rows of `launch`'s copy ([K][1 + 2 n_top]) -> per committed slot its
    logprob and its `wanted` top alternatives."""
    return [
        (row[0], [int(t) for t in row[1 + n_top : 1 + n_top + wanted]], row[1 : 1 + wanted])
        for row, ok in zip(host, valid)
        if ok
    ]
