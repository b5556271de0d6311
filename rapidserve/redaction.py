"""Keeping credentials out of what is printed, logged or written: one helper for every layer (standard library only).

A secret is the value of a flag or a setting whose name says so (`is_secret_name`: --api-key, --hf-token,
--ssl-keyfile, --ssl-keyfile-password, HF_TOKEN, HUGGING_FACE_HUB_TOKEN, VLLM_API_KEY, a JSON "client_secret"...;
not --max-tokens, --token-ids or --api-key-file, whose values are counts, ids or a path), the userinfo of a URL
(http://user:pass@host), and the credential of an Authorization header (`Bearer KEY`, `Basic ...`). Each is
replaced with `REDACTED` wherever a command line, a flag string, a settings mapping or free text is recorded:

- `redact_argv(argv)`: a command's arguments (`--api-key K`, `--api-key=K`, `HF_TOKEN=K` before a command, and
  flag strings nested in one argument: `--serve-args "--api-key K ..."`);
- `redact_args(text)`: a flag string (`--serve-args`, `$SERVE_ARGS`), re-quoted as the shell reads it;
- `redact_text(text)`: any text (log lines, error messages, a printed command);
- `redact_mapping(obj)`: settings (`vars(args)`, a config's dict), nested dicts and lists included;
- `secret_values(argv)`: the secrets themselves, for scrubbing a file a child process wrote (`scrub_file`).

The secret stays usable where it is needed: only what is recorded is redacted, never what is run or sent.
`python -m rapidserve.redaction ARG...` prints the arguments, redacted and shell-quoted (for shell scripts' logs).
"""

from __future__ import annotations

import contextlib
import re
import shlex
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REDACTED = "***"
# a name whose last part is one of these names a secret (--api-key, --hf-token, HF_TOKEN, --ssl-keyfile)
_SECRET_LAST = frozenset({"key", "token", "secret", "password", "passwd", "passphrase", "pwd", "credential",
                          "credentials", "keyfile", "apikey", "auth", "authorization", "bearer", "cookie"})
# ... and one with any part of these (--ssl-keyfile-password-file is a path, but a path named so is redacted too)
_SECRET_ANY = frozenset({"password", "passwd", "passphrase", "secret", "secrets", "apikey", "credentials"})
# names that end like a secret but are a tokenizer's special tokens
_NOT_SECRET = frozenset({"eos_token", "bos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token"})
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@'\"<>]+@")
# an Authorization header's credential: after Bearer, after Basic (base64), or the header's whole value
_AUTH_SCHEME = re.compile(r"(?i)\b(bearer|basic)(\s+)(?!\*\*\*)([^\s'\"\\,;]+)")
# flags that take several values (vLLM's --api-key KEY [KEY ...]): every value up to the next flag is hidden
_MULTI_VALUE = frozenset({"api_key"})
_JSON_LIST = re.compile(r"([\"'])([A-Za-z_][\w.-]*)\1(\s*:\s*)\[([^\]]*)\]")
_AUTH_HEADER = re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*['\"]?)(?!bearer\b|basic\b)[^\s'\"\\,;]+")
_VALUE = r"('[^']*'|\"[^\"]*\"|['\"]?(?!-)[^\s'\"]+)"  # quoted, bare (not a next flag), or after an open quote
_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w.-]*)(=|\s+)" + _VALUE)
_ASSIGN = re.compile(r"(?<![\w-])([A-Za-z_][\w.]*)=" + _VALUE)
_JSON_PAIR = re.compile(r"([\"'])([A-Za-z_][\w.-]*)\1(\s*:\s*)(\[\s*)?(\"[^\"]*\"|'[^']*'|[^\s,{}\[\]\"']+)")


def _norm(name: str) -> str:
    return name.lstrip("-").lower().replace("-", "_").replace(".", "_")


def is_secret_name(name: str) -> bool:
    """Whether a flag, environment variable or settings key of this name holds a secret (module docstring)."""
    norm = name.lstrip("-").lower().replace("-", "_").replace(".", "_")
    parts = [p for p in norm.split("_") if p]
    if not parts or norm in _NOT_SECRET or parts[0] == "no":  # --no-allow-credentials: a switch, no value
        return False
    return parts[-1] in _SECRET_LAST or any(p in _SECRET_ANY for p in parts)


def redact_text(text: str) -> str:
    """`text` with every secret it shows replaced (URL userinfo, Authorization credentials, secret flags'
    values, `SECRET_NAME=value`, `"secret_name": value`)."""
    text = _URL_USERINFO.sub(lambda m: m.group(1) + REDACTED + "@", text)
    text = _AUTH_SCHEME.sub(lambda m: m.group(1) + m.group(2) + REDACTED if _credential_like(m.group(3))
                            else m.group(0), text)
    text = _JSON_LIST.sub(lambda m: m.group(0) if not is_secret_name(m.group(2)) else
                          m.group(1) + m.group(2) + m.group(1) + m.group(3) + "[" + _redact_items(m.group(4)) + "]",
                          text)
    text = _AUTH_HEADER.sub(lambda m: m.group(1) + REDACTED, text)
    text = _FLAG.sub(lambda m: _keep_or_cut(m, 1, m.group(1) + m.group(2)), text)
    text = _ASSIGN.sub(lambda m: _keep_or_cut(m, 1, m.group(1) + "="), text)
    return _JSON_PAIR.sub(lambda m: _keep_or_cut(m, 2, m.group(1) + m.group(2) + m.group(1) + m.group(3)
                                                 + (m.group(4) or "")), text)


def _credential_like(word: str) -> bool:
    """Whether the word after `Bearer` / `Basic` looks like a credential, not prose ("a basic tokenizer", "bearer
    of"): 8+ characters with a digit or a token's punctuation, or upper case after the first letter (base64)."""
    w = word.rstrip(".")
    return len(w) >= 8 and (any(c.isdigit() or c in "+/=-_~." for c in w)
                            or (any(c.isupper() for c in w[1:]) and any(c.islower() for c in w)))


def _redact_items(items: str) -> str:
    """A JSON / Python list's items, each quoted one replaced (`['K1', 'K2']` under a secret key)."""
    return re.sub(r"([\"'])[^\"']*\1", lambda m: m.group(1) + REDACTED + m.group(1), items) if items.strip() else items


def _keep_or_cut(m: re.Match[str], name_group: int, prefix: str) -> str:
    if not is_secret_name(m.group(name_group)) or m.group(m.lastindex or 0).strip("'\"") == REDACTED:
        return m.group(0)
    value = m.group(m.lastindex or 0)
    quote = value[0] if value[:1] in ("'", '"') else ""
    return prefix + quote + REDACTED + quote


def redact_argv(argv: Iterable[str]) -> list[str]:
    """A command's arguments with every secret replaced: the value after a secret flag, after `--secret=`, after
    `SECRET_NAME=`, and any secret inside an argument (a nested flag string, a URL's userinfo)."""
    out: list[str] = []
    hide = 0  # values still to hide after a secret flag: 1, or every one up to the next flag (_MULTI_VALUE)
    for arg in map(str, argv):
        if hide and not arg.startswith("-"):
            out.append(REDACTED)
            hide = hide if hide < 0 else hide - 1
            continue
        hide = 0
        name, eq, _ = arg.partition("=")
        if arg.startswith("-") and is_secret_name(name):
            if eq:
                out.append(name + "=" + REDACTED)
            else:
                out.append(arg)
                hide = -1 if _norm(name) in _MULTI_VALUE else 1
            continue
        if eq and not arg.startswith("-") and re.fullmatch(r"[A-Za-z_][\w.]*", name) and is_secret_name(name):
            out.append(name + "=" + REDACTED)
            continue
        out.append(redact_text(arg))
    return out


def redact_args(text: str | None) -> str | None:
    """A flag string (`--serve-args`) with its secrets replaced, quoted as the shell reads it; text that does not
    split as the shell's (an open quote) is redacted as text. None stays None."""
    if text is None:
        return None
    try:
        toks = shlex.split(text)
    except ValueError:
        return redact_text(text)
    red = redact_argv(toks)
    return text if red == toks else shlex.join(red)


def redact_command(argv: Sequence[str]) -> str:
    """A command line to print or record: `argv` redacted and shell-quoted."""
    return shlex.join(redact_argv(argv))


def redact_mapping(obj: Any, secrets: Iterable[str] = ()) -> Any:
    """Settings with secrets replaced: a value under a secret name becomes REDACTED (when set), strings are
    redacted as text and rid of each of `secrets` (known values: a key given elsewhere, found in any position);
    dicts, lists and tuples are walked."""
    known = sorted({s for s in secrets if s}, key=len, reverse=True)
    if isinstance(obj, dict):
        return {k: (REDACTED if v not in (None, "") and isinstance(k, str) and is_secret_name(k)
                    else redact_mapping(v, known)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_mapping(v, known) for v in obj)
    if isinstance(obj, str):
        return _drop(redact_text(obj), known)
    return obj


def _drop(text: str, secrets: Sequence[str]) -> str:
    for s in secrets:
        text = text.replace(s, REDACTED)
    return text


def secret_values(argv: Iterable[str]) -> list[str]:
    """The secrets `argv` carries (also inside nested flag strings), longest first: what a file written by the
    command's process may echo in any form (scrub_file)."""
    toks = list(map(str, argv))
    found: set[str] = set()
    for i, arg in enumerate(toks):
        name, eq, value = arg.partition("=")
        if arg.startswith("-") and is_secret_name(name):
            if eq:
                found.add(value)
            else:  # the value after it (every one up to the next flag for --api-key: vLLM takes several)
                for v in toks[i + 1:i + 2] if _norm(name) not in _MULTI_VALUE else toks[i + 1:]:
                    if v.startswith("-"):
                        break
                    found.add(v)
        elif eq and is_secret_name(name):
            found.add(value)
        elif " " in arg and arg != redact_text(arg):
            with contextlib.suppress(ValueError):  # an open quote: nothing to split
                found.update(secret_values(shlex.split(arg)))
        for m in _URL_USERINFO.finditer(arg):
            userinfo = arg[m.end(1):m.end() - 1]
            found.update(p for p in (userinfo, userinfo.partition(":")[2]) if p)
    return sorted((s for s in found if s and s != REDACTED), key=len, reverse=True)


def scrub_file(path: str | Path, secrets: Sequence[str]) -> bool:
    """Replace every secret of `secrets` (and what `redact_text` finds) in the file at `path`; True if it changed.
    A missing file is left alone."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError:
        return False
    text = raw.decode("utf-8", "surrogateescape")
    new = _drop(redact_text(text), sorted((s for s in secrets if s), key=len, reverse=True))
    if new == text:
        return False
    p.write_bytes(new.encode("utf-8", "surrogateescape"))
    return True


if __name__ == "__main__":
    print(redact_command(sys.argv[1:]))
