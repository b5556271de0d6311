"""Keeping credentials out of the logs: `Redactor`, a logging filter, and `install`, which puts it in place.

The server never logs request headers itself, but others do: aiohttp's parser errors quote the raw
header line that failed (`b'Authorization: Bearer KEY\\x00'`, or the first 100 bytes of a header over
8190 bytes), an exception's message can carry a header value into a traceback, and an access log
format may name `%{Authorization}i`. `Redactor` rewrites every record it sees before any handler
formats it: the message (formatted with its arguments), the traceback (formatted here, then
`exc_info` dropped, so that no handler can format the exception itself or read its frames' locals),
the stack, and any `extra` attribute (strings, and strings in dicts, lists, tuples). It replaces
with ``<redacted>``: the value after an ``Authorization`` header name (to the end of the line or
the closing quote), the token after ``Bearer``, and each configured secret, in its plain form, as
`repr` and JSON escape it, and any piece of it of at least `MIN_FRAGMENT` characters at its start
or end (a header cut at a length limit).

`install` puts it where every record meets it: in the log record factory (every record of every
logger, made any time, redacted as it is made, before any filter or handler; `extra` attributes are
set on a record only after the factory, so those are left to the filters), and as a filter on every
logger that exists (the root, `aiohttp.*`, `asyncio`, `rapidserve.*`, any other: a logger's filters
see only the records made on it, not those its children propagate) and on the root logger's
handlers. It returns the function that takes it all out again.
"""

from __future__ import annotations

import json
import logging
import re
import traceback
from collections.abc import Callable, Iterable
from typing import Any

REDACTED = "<redacted>"
MIN_FRAGMENT = 8  # shortest start or end piece of a secret that is redacted on its own
# the attributes every LogRecord has; the others came as `extra`
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}
_PATTERNS = (
    # an Authorization header's value, to the end of its line or the quote that closes a repr
    re.compile(r"(?i)(authorization['\"]?\s*[:=,]\s*['\"]?)[^\r\n'\"]+"),
    re.compile(r"(?i)(bearer\s+)[^\s'\"\\,;]+"),
)


class Redactor(logging.Filter):
    """A filter that rewrites records so that no credential reaches a handler (module docstring)."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        forms: set[str] = set()
        for s in secrets:
            if s:
                forms.update((s, repr(s)[1:-1], repr(s.encode("utf-8", "surrogatepass"))[2:-1], json.dumps(s)[1:-1]))
        self._forms = sorted(forms, key=len, reverse=True)

    def redact(self, text: str) -> str:
        for pattern in _PATTERNS:
            text = pattern.sub(lambda m: m.group(1) + REDACTED, text)
        for form in self._forms:
            text = _cut(text, form)
        return text

    def _scrub(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, dict):
            return {k: self._scrub(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._scrub(v) for v in value)
        return value

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - arguments that do not fit the format: log the format alone
            message = str(record.msg)
        record.msg, record.args = self.redact(message), ()
        if record.exc_info:
            if not record.exc_text:
                record.exc_text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
            record.exc_info = None
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)
        for name, value in list(record.__dict__.items()):
            if name not in _STANDARD:
                setattr(record, name, self._scrub(value))
        return True


def install(redactor: Redactor) -> Callable[[], None]:
    """Put `redactor` in place (module docstring); returns the function that takes it out again."""
    previous = logging.getLogRecordFactory()
    active = True

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if active:
            redactor.filter(record)
        return record

    logging.setLogRecordFactory(factory)
    root = logging.getLogger()
    loggers = [root, *(lg for lg in root.manager.loggerDict.values() if isinstance(lg, logging.Logger))]
    for name in ("aiohttp.access", "aiohttp.server", "aiohttp.web", "aiohttp.internal", "asyncio", "rapidserve"):
        lg = logging.getLogger(name)  # those that must be covered even if nothing made them yet
        if lg not in loggers:
            loggers.append(lg)
    handlers = list(root.handlers)
    for f in (*loggers, *handlers):
        f.addFilter(redactor)

    def uninstall() -> None:
        nonlocal active
        active = False  # a factory installed after ours still calls it: it passes records through
        if logging.getLogRecordFactory() is factory:
            logging.setLogRecordFactory(previous)
        for f in (*loggers, *handlers):
            f.removeFilter(redactor)

    return uninstall


def _cut(text: str, secret: str) -> str:
    """`text` with every occurrence of `secret` replaced, and (for a secret of `MIN_FRAGMENT` characters or
    more) every piece of it that starts like it or ends like it over at least `MIN_FRAGMENT` characters."""
    if len(secret) < MIN_FRAGMENT:
        return text.replace(secret, REDACTED)
    spans: list[tuple[int, int]] = []
    head, tail = secret[:MIN_FRAGMENT], secret[-MIN_FRAGMENT:]
    i = text.find(head)
    while i >= 0:  # a start piece, as long as it goes on like the secret
        n = MIN_FRAGMENT
        while n < len(secret) and i + n < len(text) and text[i + n] == secret[n]:
            n += 1
        spans.append((i, i + n))
        i = text.find(head, i + n)
    j = text.find(tail)
    while j >= 0:  # an end piece, as far back as it matches the secret
        end, n = j + MIN_FRAGMENT, MIN_FRAGMENT
        while n < len(secret) and end - n - 1 >= 0 and text[end - n - 1] == secret[-n - 1]:
            n += 1
        spans.append((end - n, end))
        j = text.find(tail, j + 1)
    if not spans:
        return text
    out, at = [], 0
    for a, b in sorted(spans):
        if b <= at:
            continue
        out.append(text[at:max(a, at)])
        if a >= at:
            out.append(REDACTED)
        at = b
    out.append(text[at:])
    return "".join(out)
