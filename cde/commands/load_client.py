"""One OpenAI completion or chat request over HTTP, timed and checked the way `cde bench serve`
and `cde bench soak` report it: time to first token, the gaps between SSE chunks, when each
64-token block was complete, each choice's text and finish_reason, and how the request ended.

How a request ends (`Outcome.status`):
  ok              complete: every choice has a finish_reason, a stream ended with [DONE]
  error           an explicit error: an HTTP error with an OpenAI error body, or an SSE error event
  broken          anything else: refused/reset connection, malformed or truncated response
  hung_up         we closed the stream on purpose (`hang_up_after` chunks)
  client_timeout  our own deadline (`deadline`) passed first
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx

from cde.shared.config import PAGE


@dataclass
class Outcome:
    status: str = "ok"
    kind: str | None = None  # why it is not ok: "http_429", "sse_error", "no_done", "connect", ...
    message: str = ""
    param: str | None = None  # of an explicit error
    code: str | None = None
    texts: dict[int, str] = field(default_factory=lambda: defaultdict(str))
    finish: dict[int, str | None] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    attribution: dict[int, dict] = field(default_factory=dict)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    ttft: float | None = None  # seconds from sending to the first chunk with text
    itl: list[float] = field(default_factory=list)  # between consecutive chunks with text
    # Per chunk that carried token ids (`return_token_ids`): seconds from sending, token ids so far.
    token_times: list[tuple[float, int]] = field(default_factory=list)
    latency: float = 0.0

    def block_times(self, page: int = PAGE) -> list[float]:
        """Seconds from sending until each block of the answer was complete: the first chunk
        whose token ids reach the block's end (the first block is the prompt's tail block, the
        last one ends with the answer). Needs `return_token_ids` and the usage's prompt_tokens;
        [] without them."""
        if not self.token_times or not self.prompt_tokens:
            return []
        total = self.token_times[-1][1]
        ends = list(range(page - self.prompt_tokens % page, total, page)) + [total]
        return [next(t for t, n in self.token_times if n >= end) for end in ends]

    def fail(self, status: str, kind: str, message: str = "") -> Outcome:
        self.status, self.kind, self.message = status, kind, message
        return self


def _choice_text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    return ((choice.get("delta") or choice.get("message") or {}).get("content")) or ""


def _take_choices(out: Outcome, obj: dict) -> bool:
    """Adds one response body or chunk to `out`; True if it carried text."""
    got_text = False
    for c in obj.get("choices") or []:
        i = c.get("index", 0)
        piece = _choice_text(c)
        out.texts[i] += piece
        got_text |= bool(piece)
        out.token_ids[i] += c.get("token_ids") or []
        if c.get("finish_reason") is not None:
            out.finish[i] = c["finish_reason"]
        if c.get("attribution") is not None:
            out.attribution[i] = c["attribution"]
    usage = obj.get("usage")
    if usage:
        out.completion_tokens = usage.get("completion_tokens", 0)
        out.prompt_tokens = usage.get("prompt_tokens", 0)
    return got_text


def _error_from(response_json: Any, out: Outcome, kind: str) -> Outcome:
    err = response_json.get("error") if isinstance(response_json, dict) else None
    if not isinstance(err, dict) or "message" not in err:
        return out.fail("broken", kind + "_no_error_body")
    out.fail("error", kind, err["message"])
    out.param, out.code = err.get("param"), err.get("code")
    return out


async def _stream(response: httpx.Response, out: Outcome, t0: float, hang_up_after: int | None) -> None:
    chunks, last, done = 0, None, False
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        obj = json.loads(line[6:])
        if "error" in obj:
            _error_from(obj, out, "sse_error")
            continue  # [DONE] still has to follow
        now = time.perf_counter()
        tokens = sum(len(ids) for ids in out.token_ids.values())
        got_text = _take_choices(out, obj)
        if sum(len(ids) for ids in out.token_ids.values()) > tokens:
            out.token_times.append((now - t0, sum(len(ids) for ids in out.token_ids.values())))
        if got_text:
            if out.ttft is None:
                out.ttft = now - t0
            else:
                out.itl.append(now - last)
            last = now
        chunks += 1
        if hang_up_after is not None and chunks >= hang_up_after:
            out.fail("hung_up", "hung_up")
            return
    if not done:
        out.fail("broken", "no_done", "the stream ended without [DONE]")


async def send(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    *,
    headers: dict | None = None,
    hang_up_after: int | None = None,
    deadline: float | None = None,
) -> Outcome:
    """POST `body` to `url` (.../v1/completions or .../v1/chat/completions)."""
    out = Outcome()
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(deadline):
            async with client.stream("POST", url, json=body, headers=headers) as response:
                if response.status_code >= 400:
                    raw = await response.aread()
                    try:
                        return _error_from(json.loads(raw), out, f"http_{response.status_code}")
                    except ValueError:
                        return out.fail(
                            "broken", f"http_{response.status_code}_no_error_body", raw[:200].decode(errors="replace")
                        )
                if body.get("stream"):
                    await _stream(response, out, t0, hang_up_after)
                else:
                    _take_choices(out, json.loads(await response.aread()))
                    out.ttft = time.perf_counter() - t0
    except TimeoutError:
        return out.fail("client_timeout", "client_timeout")
    except httpx.TimeoutException as exc:
        return out.fail("broken", "timeout", repr(exc))
    except httpx.ConnectError as exc:
        return out.fail("broken", "connect", repr(exc))
    except (httpx.HTTPError, ValueError) as exc:  # reset connection, malformed JSON
        return out.fail("broken", type(exc).__name__, repr(exc))
    out.latency = time.perf_counter() - t0
    if out.status == "ok":
        missing = [i for i in range(body.get("n", 1)) if out.finish.get(i) is None]
        if missing:
            out.fail("broken", "no_finish_reason", f"choices {missing} have no finish_reason")
    return out


def metric_samples(text: str) -> dict[str, float]:
    """A Prometheus exposition as samples by `name{labels}`, plus each name's sum over its
    labels under the plain `name`."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
            name = key.split("{", 1)[0]
            if name != key:
                out[name] = out.get(name, 0.0) + float(value)
    return out


def write_json(obj: Any, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=2)
