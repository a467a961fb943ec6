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
- Under journald (``$JOURNAL_STREAM`` names the device and inode of our stderr, as
  systemd.exec(5) says to check) each line starts with the syslog priority ``<N>``
  (`PRIORITIES`), which journald strips and stores as PRIORITY, so ``journalctl -p
  warning`` finds warnings. The JSON after it is unchanged. Anywhere else (a terminal, a
  file, a pipe) no prefix is written.

- Agent- and relay-chosen text in a field is escaped like every output of it
  (`buzzwire.contract.printable_json`): C0 and C1 controls, line separators and bidi
  controls become `\\uNNNN`; the line stays valid JSON of the same value.

WARNING: journald splits on newlines, so a field value must never break the line; that is
why everything goes through `printable_json` (which escapes control characters).
"""

from __future__ import annotations

import datetime
import io
import logging
import os
import sys
from collections.abc import Mapping
from typing import TextIO

from buzzwire.contract import printable_json

__all__ = [
    "log_event", "setup_logging", "format_record", "journald_stream", "LEVELS", "PRIORITIES",
    "ROOT_LOGGER",
]

#: The logger tree every module logs under (`buzz_broker.<module>`).
ROOT_LOGGER = "buzz_broker"

#: Configured level name -> logging level. The config validates against these keys.
LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

#: logging level -> syslog priority (sd-daemon(3) prefixes): the nearest one at or above.
PRIORITIES: tuple[tuple[int, int], ...] = (
    (logging.CRITICAL, 2),
    (logging.ERROR, 3),
    (logging.WARNING, 4),
    (logging.INFO, 6),
    (logging.DEBUG, 7),
)

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


def _priority(levelno: int) -> int:
    for level, priority in PRIORITIES:
        if levelno >= level:
            return priority
    return 7


def journald_stream(stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """True when `stream` is the journald stream ``$JOURNAL_STREAM`` names (device:inode)."""
    env = os.environ if environ is None else environ
    wanted = env.get("JOURNAL_STREAM", "")
    if not wanted:
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        return False
    return wanted == f"{st.st_dev}:{st.st_ino}"


class _JsonFormatter(logging.Formatter):
    """Formats any record as one JSON line; `log_event` records carry their fields.

    With `prefix`, the line starts with ``<N>`` (the record's syslog priority) for journald.
    """

    def __init__(self, prefix: bool = False) -> None:
        super().__init__()
        self._prefix = prefix

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
        # printable_json: json.dumps escapes C0 but writes C1 controls (an 8-bit CSI) and
        # bidi overrides raw; a relay notice or a name in a field must not reach a terminal
        # reading the journal as anything but text.
        text = printable_json(line, compact=True, default=str)
        return f"<{_priority(record.levelno)}>{text}" if self._prefix else text


def format_record(record: logging.LogRecord) -> str:
    """The JSON line `setup_logging`'s handler writes for `record` (tests scan these)."""
    return _FORMATTER.format(record)


_FORMATTER = _JsonFormatter()


def setup_logging(level: str = "info", stream: TextIO | None = None,
                  environ: Mapping[str, str] | None = None) -> None:
    """Send the ``buzz_broker`` logger tree to `stream` (stderr) as JSON lines.

    Args:
        level: one of `LEVELS` (the config has already validated it).
        stream: where the lines go; stderr unless a test gives another.
        environ: where ``$JOURNAL_STREAM`` is read (the process's unless given).

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
    target = stream if stream is not None else sys.stderr
    handler = logging.StreamHandler(target)
    handler.setFormatter(_JsonFormatter(prefix=journald_stream(target, environ)))
    setattr(handler, "_buzz_broker", True)
    root.addHandler(handler)
    root.setLevel(LEVELS[level])
    root.propagate = False
