"""The long-running processes' log format (the node agent, the controller): one JSON object per line
on stderr, what a log collector on a node wants. Standard library only."""

from __future__ import annotations

import json
import logging


class JsonFormatter(logging.Formatter):
    """A record as {"ts", "level", "msg", and its `extra` fields}."""

    _STD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message"}

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "msg": record.getMessage()}
        out.update({k: v for k, v in record.__dict__.items() if k not in self._STD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def to_stderr(level: int = logging.INFO) -> None:
    """Every logger's records, as JSON lines on stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
