"""The response's input attribution (`attribution.inputs`) from the `InputAttribution` each
block result carries: per generated token its top input positions, per chunk the aggregated
ones (the official `aggregate_chunk`), with the tokens' text. Positions count from the start of
the prompt; `offset`, `start` and `end` count the completion's tokens, like the concept chunks'."""

from __future__ import annotations

from collections.abc import Callable

from cde.shared.protocol import InputAttribution


def render_block(ia: InputAttribution, prompt_len: int, decode: Callable[[list[int]], str]) -> dict:
    """One block's piece: `{"tokens": [...], "chunks": [...]}`."""

    def text(t: int) -> str:
        return decode([t])

    tokens = [
        {
            "offset": p - prompt_len,
            "token_id": t,
            "text": text(t),
            "inputs": [
                {"position": q, "token_id": qt, "text": text(qt), "contribution": s} for q, qt, s in zip(qs, qts, ss)
            ],
        }
        for p, t, qs, qts, ss in zip(ia.positions, ia.token_ids, ia.top_positions, ia.top_token_ids, ia.top_scores)
    ]
    chunks = [
        {
            "start": span[0] - prompt_len,
            "end": span[1] - prompt_len,
            "inputs": [{"position": q, "token_id": qt, "text": text(qt), "score": s} for q, qt, s in zip(qs, qts, ss)],
        }
        for span, qs, qts, ss in zip(ia.chunk_spans, ia.chunk_positions, ia.chunk_token_ids, ia.chunk_scores)
    ]
    return {"tokens": tokens, "chunks": chunks}


def attach(attribution: dict | None, pieces: list[dict]) -> dict:
    """The choice's attribution with `inputs` (every block's tokens and chunks, in order); each
    concept chunk of the same span gains its `inputs`."""
    out = dict(attribution or {})
    inputs = {"tokens": [t for p in pieces for t in p["tokens"]], "chunks": [c for p in pieces for c in p["chunks"]]}
    by_span = {(c["start"], c["end"]): c["inputs"] for c in inputs["chunks"]}
    if "chunks" in out:
        out["chunks"] = [
            {**c, "inputs": by_span[(c["start"], c["end"])]} if (c["start"], c["end"]) in by_span else c
            for c in out["chunks"]
        ]
    out["inputs"] = inputs
    return out
