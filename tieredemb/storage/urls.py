"""Store URLs with their passwords taken out, for reprs, messages, logs and reports.

A Redis URL carries a password in two places redis-py reads: ``redis://user:password@host`` and the
query, ``redis://host/0?password=...``. Both become ``***``.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***``, the rest as given."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    user, at, host = netloc.rpartition("@")  # a password may hold "@": the host is after the last
    if at and ":" in user:
        netloc = f"{user.partition(':')[0]}:***@{host}"
    path, q, query = tail.partition("?")
    if q:
        query = "&".join(map(_redact_argument, query.split("&")))
    return f"{scheme}://{netloc}{path}{q}{query}"


def _redact_argument(item: str) -> str:
    """One ``key=value`` of a query: the value of ``password`` replaced."""
    key = item.partition("=")[0]
    return f"{key}=***" if unquote(key).lower() == "password" else item


def redact_text(text: str) -> str:
    """``text`` with every URL in it redacted."""
    return _URL.sub(lambda m: redact(m.group(0)), text)


__all__ = ["redact", "redact_text"]
