"""Keep secrets out of reports, logs, exceptions and reprs.

Passwords reach us inside URLs (redis://user:pw@host, unix:///s.sock?password=pw)
and under config keys (password, mac_key, ...). Anything that writes a URL or
a config somewhere a person or a file can see it goes through these first.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
# config keys whose values are secrets (compared lower-case, with - as _)
SECRET_KEYS = frozenset({"password", "passwd", "pass", "secret", "token", "auth_token", "mac_key", "auth_key",
                         "api_key", "access_key", "secret_key"})
# a URL with userinfo inside a longer string (e.g. an error message)
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:@/\s]*):(?P<pw>[^@\s]*)@")
# a secret query parameter inside a longer string
_QUERY = re.compile(r"(?P<head>[?&](?P<name>[A-Za-z_-]+)=)(?P<value>[^&#\s'\"]*)")


def is_secret_key(name: str) -> bool:
    return name.lower().replace("-", "_") in SECRET_KEYS


def redact_url(url: str) -> str:
    """The URL with the userinfo password and any secret query parameter
    replaced by ***; anything that does not parse as a URL is returned with
    user:password@ patterns masked."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return redact_text(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            netloc = f"{userinfo.split(':', 1)[0]}:{MASK}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(is_secret_key(k) for k, _ in pairs):
            query = urlencode([(k, MASK if is_secret_key(k) else v) for k, v in pairs], safe="*")
    if netloc == parts.netloc and query == parts.query:
        return url
    # by hand: urlunsplit drops the empty authority of unix:///path
    if parts.scheme:
        out = f"{parts.scheme}://{netloc}{parts.path}"
    else:
        out = urlunsplit(parts._replace(netloc=netloc, query="", fragment=""))
    return out + (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")


def redact_text(text: str) -> str:
    """Mask user:password@ and secret query parameters in every URL inside free text."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    return _QUERY.sub(lambda m: m["head"] + MASK if is_secret_key(m["name"]) else m[0], text)


def redact(obj: Any) -> Any:
    """A copy of a JSON-like structure with secrets masked: values under
    secret keys, and passwords inside URL strings."""
    if isinstance(obj, dict):
        return {k: (MASK if v is not None and isinstance(k, str) and is_secret_key(k) else redact(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(redact(v) for v in obj)
    if isinstance(obj, str) and "://" in obj:
        return redact_url(obj) if "://" in obj[:16] and " " not in obj else redact_text(obj)
    return obj
