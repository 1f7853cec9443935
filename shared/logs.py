"""Structured logs: one JSON object per line on stderr, for the gateway and the workers alike.

Fields passed with `log.info(msg, extra={...})` (request_id, status, ...) become keys of the
object, so a request is followed across processes by grepping its id. Request content (prompts,
generated text) is logged only when the operator asks for it (`--log-requests`)."""

from __future__ import annotations

import json
import logging
import sys

# uvicorn adds `color_message`, the same text with terminal colours.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
    "color_message",
}


class JsonFormatter(logging.Formatter):
    def __init__(self, component: str):
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "component": self.component,
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def setup_logging(component: str, level: str | int) -> None:
    """Route every logger (ours, uvicorn's) through one JSON handler on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(component))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if isinstance(level, str) else level)
