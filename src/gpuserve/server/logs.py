"""Log setup: plain text or one JSON object per line, and the access log.

``--log-format json`` writes each record as a JSON object with ``ts`` (UTC, ISO 8601),
``level``, ``logger``, ``message``, any ``extra`` fields the call passed (the access log passes
``model``, ``version``, ``status``, ``rows``, ``total_ms``, ``client``, ...) and ``exc`` for a
traceback. No dependency beyond the standard library.

The access log (logger ``gpuserve.access``, level INFO, one line per HTTP request) is off
unless ``--access-log`` turns it on; it never carries tensor contents, only sizes.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import orjson

ACCESS_LOGGER = "gpuserve.access"

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys()
    | {"message", "asctime", "taskName", "color_message"}
)


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(entry, default=str).decode()


TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def configure_logging(level: str, log_format: str = "text", access_log: bool = False) -> None:
    """Send logs to stderr at ``level`` as text or JSON lines.

    Args:
        level: ``debug``, ``info``, ``warning`` or ``error``.
        log_format: ``text`` or ``json``.
        access_log: Show the access log (INFO) whatever ``level`` is.
    """
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    access = logging.getLogger(ACCESS_LOGGER)
    access.setLevel(logging.INFO if access_log else logging.WARNING)
