"""Where `cde eval` sends its requests: a running server (`--url`, the real HTTP API) or an
engine in this process (`--model`). Both take the same OpenAI-style request bodies, CDE's
extensions included (tokens_per_step, confidence_threshold, flashblock, steering, attribution),
and both count a request's denoising steps from its `step` events (stream_denoise), so tokens
per forward pass mean the same thing on either side (the engine's step loop:
cde/train/engine_replies.py, which the training log's held-out accuracy runs too)."""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from cde.train import engine_replies
from cde.train.engine_replies import Batch, Completion

if TYPE_CHECKING:
    from cde.shared.settings import EngineArgs


class EngineBackend:
    """An Engine in this process; bodies go through the gateway's own request parsing (the
    training program never does: it builds its requests from token ids, cde/train/heldout.py)."""

    def __init__(self, settings: EngineArgs):
        from cde.gateway.concepts import ConceptLabels
        from cde.gateway.model_info import ModelInfo
        from cde.worker.engine import Engine

        self.engine = Engine(settings)
        model_dir = settings.model
        cfg = self.engine.cfg
        self.info = ModelInfo.from_config("eval", cfg)
        self.labels = ConceptLabels.load(model_dir)
        self.cfg = cfg

    def _request(self, body: dict) -> Any:
        from cde.gateway.attribution_render import renderer
        from cde.gateway.params import generate_requests
        from cde.gateway.schemas import CompletionRequest

        tok = self.engine.tokenizer
        ids = tok.chat_prompt(body["messages"]) if "messages" in body else tok.encode(body["prompt"])
        fields = {k: v for k, v in body.items() if k not in ("messages", "prompt")}
        parsed = CompletionRequest.model_validate(
            {**fields, "model": "eval", "prompt": ids, "stream": True, "stream_denoise": True}
        )
        [req] = generate_requests(parsed, [ids], parsed.max_tokens, self.info, self.labels, uuid.uuid4().hex)
        return req, renderer([req], tok, self.labels, self.info)

    def run(self, bodies: list[dict]) -> Batch:
        reqs = [self._request(b) for b in bodies]
        r = engine_replies.run(self.engine, [req for req, _ in reqs])
        out = []
        for i, (req, render) in enumerate(reqs):
            attribution = (
                render(0, r.attribution[i], len(r.token_ids[i]), r.end_position[i])
                if req.attribution is not None
                else None
            )
            out.append(
                Completion(
                    self.engine.tokenizer.decode(r.token_ids[i]),
                    r.tokens[i],
                    r.steps[i],
                    attribution["chunks"] if attribution else None,
                )
            )
        return Batch(out, r.seconds)


class HttpBackend:
    """A CDE server: /v1/chat/completions or /v1/completions, streamed with step events."""

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None, concurrency: int = 32):
        import httpx

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=600)
        self.model = model or self.client.get(f"{self.url}/v1/models").json()["data"][0]["id"]
        self.concurrency = concurrency

    def _one(self, body: dict) -> Completion:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        payload = {**body, "model": self.model, "stream": True, "stream_denoise": True}
        text, steps, tokens, chunks = [], 0, 0, []
        with self.client.stream("POST", self.url + path, json=payload) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"{path}: HTTP {resp.status_code}: {resp.read().decode()[:300]}")
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    raise RuntimeError(f"{path}: {data['error']}")
                for c in data.get("choices", []):
                    if data.get("object", "").endswith(".step"):
                        steps += 1
                        tokens += len(c["token_ids"])
                        continue
                    text.append(c.get("delta", {}).get("content") or c.get("text") or "")
                    chunks += (c.get("attribution") or {}).get("chunks", [])
        return Completion("".join(text), tokens, steps, chunks if "attribution" in body else None)

    def run(self, bodies: list[dict]) -> Batch:
        start = time.perf_counter()
        with ThreadPoolExecutor(self.concurrency) as pool:
            out = list(pool.map(self._one, bodies))
        return Batch(out, time.perf_counter() - start)
