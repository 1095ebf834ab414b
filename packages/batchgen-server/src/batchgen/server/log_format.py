"""How the server's log looks: plain text lines, or one JSON object per line (``--log-format json``).

``configure_logging`` puts one handler on the root logger, writing to stderr; uvicorn's loggers
propagate to it (the server starts uvicorn with ``log_config=None``). A JSON line has
``timestamp`` (UTC, ISO 8601), ``level``, ``logger``, ``event`` (``batch.completed``,
``http.request``, … or ``log``), ``message``, and the record's structured fields (``batch_id``,
counts, ``duration_s``, ``reason``, ``method``, ``path``, ``status``, …); a traceback goes under
``exception``.

The access log (one line per HTTP request) is off unless ``--access-log`` is given or the level is
``debug``: polling clients would otherwise fill the log. Each access line names its request's id
(``request_ids``, the response's ``x-request-id``): a ``request_id`` field in JSON, and
`` request_id=req_…`` at the end of a text line (as does any other record that carries one).
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Attributes every LogRecord has: not structured fields of their own.
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "color_message",  # uvicorn's message with terminal colours
}


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, then `` request_id=…`` when the record names a request."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        request_id = getattr(record, "request_id", None)
        return line if request_id is None else f"{line} request_id={request_id}"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "timestamp": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": "log",
            "message": record.getMessage(),
        }
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            client, method, path, _, status = record.args
            entry.update(event="http.request", client=client, method=method, path=path, status=status)
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRIBUTES and not key.startswith("_"):
                entry[key] = value if isinstance(value, str | int | float | bool | None) else str(value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, log_format: str) -> None:
    """One stderr handler on the root logger, in ``log_format``; quiet libraries."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore"):  # one line (or several) per upstream request is noise
        logging.getLogger(noisy).setLevel(logging.WARNING)
