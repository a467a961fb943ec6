"""One structured line per event on stderr, for journald.

Rules:
- `log_event(logger, name, **fields)` is the only way the daemon logs. Each event becomes
  one JSON object on one line: ``time`` (RFC 3339 UTC), ``level``, ``logger``, ``event``
  and the caller's fields, in that order.
- Fields are facts an operator needs (pubkey, action, requestId, status, code, duration).
  They never carry argument content, credentials, PINs or secret keys: the callers own
  that rule, this module cannot tell a secret from a string.
- Values that JSON cannot carry are written with ``str()``; a logging call never raises
  because of a field.
- `setup_logging(level)` is called once by `serve` (and by other commands that log). It
  installs one stderr handler on the ``buzz_broker`` logger tree; plain `logging` records
  (custody logs that way) come out in the same JSON shape, their text as ``message``.

WARNING: journald splits on newlines, so a field value must never break the line; that is
why everything goes through `json.dumps` (which escapes control characters).
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import TextIO

__all__ = ["log_event", "setup_logging", "format_record", "LEVELS", "ROOT_LOGGER"]

#: The logger tree every module logs under (`buzz_broker.<module>`).
ROOT_LOGGER = "buzz_broker"

#: Configured level name -> logging level. The config validates against these keys.
LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

_FIELDS_ATTR = "buzz_fields"
_EVENT_ATTR = "buzz_event"


def log_event(
    logger: logging.Logger, name: str, /, *, level: int = logging.INFO, **fields: object
) -> None:
    """Log the event `name` with `fields` as one JSON line.

    Args:
        logger: a logger under ``buzz_broker.``.
        name: the event name, a short snake_case word (``ready``, ``verdict``, ``stopping``).
        level: a `logging` level; INFO unless given.
        fields: JSON-able facts. Never secrets or argument content.
    """
    if not logger.isEnabledFor(level):
        return
    logger.log(level, name, extra={_EVENT_ATTR: name, _FIELDS_ATTR: fields})


class _JsonFormatter(logging.Formatter):
    """Formats any record as one JSON line; `log_event` records carry their fields."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, tz=datetime.timezone.utc)
        line: dict[str, object] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        event = getattr(record, _EVENT_ATTR, None)
        if event is None:
            # A plain logging call (custody, libraries): keep its text, and only the
            # exception's type name, because a traceback's text may quote a secret.
            line["event"] = "message"
            line["message"] = record.getMessage()
            if record.exc_info and record.exc_info[0] is not None:
                line["exception"] = record.exc_info[0].__name__
        else:
            line["event"] = event
            fields = getattr(record, _FIELDS_ATTR, {})
            for key, value in fields.items():
                if key not in line:
                    line[key] = value
        return json.dumps(line, ensure_ascii=False, default=str, separators=(",", ":"))


def format_record(record: logging.LogRecord) -> str:
    """The JSON line `setup_logging`'s handler writes for `record` (tests scan these)."""
    return _FORMATTER.format(record)


_FORMATTER = _JsonFormatter()


def setup_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """Send the ``buzz_broker`` logger tree to `stream` (stderr) as JSON lines.

    Args:
        level: one of `LEVELS` (the config has already validated it).
        stream: where the lines go; stderr unless a test gives another.

    Raises:
        ValueError: `level` is not one of `LEVELS` (a bug: the config checks it).
    """
    if level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; expected one of {sorted(LEVELS)}")
    root = logging.getLogger(ROOT_LOGGER)
    # Idempotent: a second call (tests, reload) replaces our handler instead of doubling lines.
    for handler in list(root.handlers):
        if getattr(handler, "_buzz_broker", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(_JsonFormatter())
    setattr(handler, "_buzz_broker", True)
    root.addHandler(handler)
    root.setLevel(LEVELS[level])
    root.propagate = False
