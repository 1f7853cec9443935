"""A fluency measure the model itself provides: the unsteered model's masked-token loss on a reply.

The reply is scored in two passes over the dense forward (cde/train/train_model.py, the engine's
computation): its even positions masked, then its odd ones; each reply token's cross-entropy is
read where it is masked, with half its neighbours visible, as in the middle of denoising. Word
salad and loops the model would not write unsteered score high; its own unsteered replies score
low. Mean over all reply tokens (nats)."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from cde.shared.config import MASK_ID
from cde.shared.tokenizer import get_tokenizer
from cde.train.train_model import TrainModel, block_causal_mask


@torch.no_grad()
def masked_token_loss(model: TrainModel, prompt_ids: list[int], reply_ids: list[int]) -> tuple[float, int]:
    """(summed cross-entropy, tokens) of the reply, its positions masked in two interleaved halves."""
    lookup = cast(torch.Tensor, model.lookup)  # a buffer: nn.Module's attribute type is wider
    ids = torch.tensor([prompt_ids + reply_ids], device=lookup.device)[:, : model.cfg.context_len]
    n = ids.shape[1]
    pos = torch.arange(n, device=ids.device)[None]
    mask = block_causal_mask(torch.zeros_like(ids))
    reply = torch.arange(len(prompt_ids), n, device=ids.device)
    total, count = 0.0, 0
    for half in (reply[0::2], reply[1::2]):
        if half.numel() == 0:
            continue
        x = ids.clone()
        x[0, half] = MASK_ID
        logits = model.logits(model.hidden(x, pos, mask)[0, half].float())
        total += float(F.cross_entropy(logits, lookup[ids[0, half]], reduction="sum"))
        count += half.numel()
    return total, count


def chat_loss(model: TrainModel, prompts: list[str], replies: list[str]) -> float:
    """Mean masked-token loss per reply token over chat exchanges (user prompt, assistant reply)."""
    tok = get_tokenizer(True)
    total, count = 0.0, 0
    for prompt, reply in zip(prompts, replies):
        if not reply.strip():
            continue
        t, c = masked_token_loss(model, tok.chat_prompt([{"role": "user", "content": prompt}]), tok.encode(reply))
        total, count = total + t, count + c
    return total / count if count else float("nan")
