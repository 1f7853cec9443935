"""The response's input attribution (`attribution.inputs`) from the `InputAttribution` each
block result carries: per generated token its top input positions, per chunk the aggregated
ones (the official `aggregate_chunk`), with the tokens' text. Positions count from the start of
the prompt; `offset`, `start` and `end` count the completion's tokens, like the concept chunks'."""

from __future__ import annotations

from collections.abc import Callable

from cde.gateway.attribution_schemas import Attribution, ConceptChunk, InputAttribution, InputChunk, InputToken
from cde.shared.protocol import InputAttribution as BlockInputs


def render_block(ia: BlockInputs, prompt_len: int, decode: Callable[[list[int]], str]) -> InputAttribution:
    """One block's piece: `{"tokens": [...], "chunks": [...]}`."""

    def text(t: int) -> str:
        return decode([t])

    tokens: list[InputToken] = [
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
    chunks: list[InputChunk] = [
        {
            "start": span[0] - prompt_len,
            "end": span[1] - prompt_len,
            "inputs": [{"position": q, "token_id": qt, "text": text(qt), "score": s} for q, qt, s in zip(qs, qts, ss)],
        }
        for span, qs, qts, ss in zip(ia.chunk_spans, ia.chunk_positions, ia.chunk_token_ids, ia.chunk_scores)
    ]
    return {"tokens": tokens, "chunks": chunks}


def attach(attribution: Attribution | None, pieces: list[InputAttribution]) -> Attribution:
    """The choice's attribution with `inputs` (every block's tokens and chunks, in order); each
    concept chunk of the same span gains its `inputs`."""
    out: Attribution = {**attribution} if attribution else {}
    inputs: InputAttribution = {
        "tokens": [t for p in pieces for t in p["tokens"]],
        "chunks": [c for p in pieces for c in p["chunks"]],
    }
    by_span = {(c["start"], c["end"]): c["inputs"] for c in inputs["chunks"]}
    if "chunks" in out:
        out["chunks"] = [_with_inputs(c, by_span.get((c["start"], c["end"]))) for c in out["chunks"]]
    out["inputs"] = inputs
    return out


def _with_inputs(chunk: ConceptChunk, inputs: list | None) -> ConceptChunk:
    return chunk if inputs is None else {**chunk, "inputs": inputs}
