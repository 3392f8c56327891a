"""ASGI middleware in front of the app: the API key (`BearerAuth`), the ``Host`` check (`HostGuard`), and
absolute-form request targets read as origin-form (`OriginForm`). The first two answer in OpenAI's error
shape before the app sees the request and before any body is read.

    app = OriginForm(HostGuard(BearerAuth(app, "KEY"), allowed_hosts("127.0.0.1", ["embed.example.com"])))

Why the ``Host`` check: a server without a key on 127.0.0.1 is reachable from any web page the user
opens, through DNS rebinding (``evil.example`` re-resolved to 127.0.0.1): the browser then sends
``Host: evil.example``. Refusing every ``Host`` but the bound address and the names allowed closes it
(and a body must be declared JSON, which a page cannot send cross-origin without a CORS preflight,
which this server never answers).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from typing import Iterable
from urllib.parse import unquote

from starlette.responses import JSONResponse

from .errors import InvalidRequest, Unauthorized

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key (probes)
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")


class BearerAuth:
    """ASGI middleware: every HTTP request to a path outside `OPEN_PATHS` needs ``Authorization: Bearer
    <api_key>``; others get 401 in OpenAI's error shape before the app sees them (no body is read).
    The key is compared in constant time (SHA-256 digests, `hmac.compare_digest`). ``on_refused``, when
    given, is called with ``"missing"`` or ``"invalid"`` for each 401 (the app counts them in /metrics)."""

    def __init__(self, app, api_key: str, on_refused=None):
        check_api_key(api_key)
        self.app, self.on_refused = app, on_refused
        self._digest = hashlib.sha256(api_key.encode("ascii")).digest()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or route_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = [v for k, v in scope["headers"] if k == b"authorization"]
        scheme, _, token = given[0].strip().partition(b" ") if len(given) == 1 else (b"", b"", b"")
        if scheme.lower() == b"bearer" and hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._digest):
            return await self.app(scope, receive, send)
        if given:
            exc, challenge = Unauthorized("the API key is not valid"), 'Bearer realm="dice-fast", error="invalid_token"'
        else:
            exc = Unauthorized("no API key: send it as the header 'Authorization: Bearer <key>'")
            challenge = 'Bearer realm="dice-fast"'
        if self.on_refused is not None:
            self.on_refused("invalid" if given else "missing")
        headers = {"WWW-Authenticate": challenge, "Connection": "close"}
        await JSONResponse(exc.body(), status_code=401, headers=headers)(scope, receive, send)


class HostGuard:
    """ASGI middleware: a request whose ``Host`` header (port aside) is not in ``allowed`` gets 400
    ``code: "host_not_allowed"`` (and the connection is closed); ``allowed`` holds lower-case names
    and addresses (see `allowed_hosts`), ``"*"`` lets any ``Host`` through, ``"<ip>"`` any IP
    address (a name cannot be re-bound to an address a page did not name)."""

    def __init__(self, app, allowed: Iterable[str], on_refused=None):
        self.app, self.allowed, self.on_refused = app, frozenset(h.lower() for h in allowed), on_refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or "*" in self.allowed:
            return await self.app(scope, receive, send)
        given = [v for k, v in scope["headers"] if k == b"host"]
        host = host_name(given[0].decode("latin-1")) if len(given) == 1 else None
        if host is not None and (host in self.allowed or ("<ip>" in self.allowed and _is_ip(host))):
            return await self.app(scope, receive, send)
        if self.on_refused is not None:
            self.on_refused()
        exc = InvalidRequest("the Host header is not one this server answers to (it is bound to another address; "
                             "a name must be allowed with --allowed-hosts)", param="Host")
        exc.code = "host_not_allowed"
        await JSONResponse(exc.body(), status_code=400, headers={"Connection": "close"})(scope, receive, send)


class OriginForm:
    """ASGI middleware: a request whose target is in absolute form (``POST http://host:port/v1/embeddings``,
    which RFC 9112 3.2.2 says a server MUST accept) is passed on with the target's path and query, and
    its authority as the ``Host`` header, which the RFC says such a target replaces. uvicorn's h11
    protocol left the whole URL as the path: every route answered 404. Outermost, so `HostGuard` checks
    the authority the request named."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        target = scope.get("raw_path") or b""
        scheme, sep, rest = target.partition(b"://")
        if scope["type"] == "http" and sep and scheme.lower() in (b"http", b"https"):
            authority, slash, path = rest.partition(b"/")
            raw_path = b"/" + path if slash else b"/"
            headers = [(k, v) for k, v in scope["headers"] if k != b"host"] + [(b"host", authority)]
            scope = dict(scope, raw_path=raw_path, path=unquote(raw_path.decode("latin-1")), headers=headers)
        return await self.app(scope, receive, send)


def allowed_hosts(bind: str, extra: Iterable[str] = ()) -> list[str]:
    """The ``Host`` values a server bound to ``bind`` answers to: that address (every IP address for
    a wildcard such as 0.0.0.0), loopback's names for a loopback address, and ``extra``."""
    bind = bind.lower().strip("[]")
    out = {bind} - set(WILDCARDS)
    if bind in WILDCARDS:
        out |= {"<ip>", "localhost"}
    elif bind in LOOPBACK_NAMES or (_is_ip(bind) and ipaddress.ip_address(bind).is_loopback):
        out |= set(LOOPBACK_NAMES)
    out |= {h.lower().strip() for h in extra if h.strip()}
    return sorted(out)


def host_name(value: str) -> str:
    """The name or address of a ``Host`` header, without its port or an IPv6 literal's brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def check_api_key(key) -> str:
    """``key`` if it can be an API key (a non-empty string of visible ASCII), else ValueError."""
    if not isinstance(key, str) or not key or not all("!" <= c <= "~" for c in key):
        raise ValueError("an API key must be a non-empty string of visible ASCII characters (no spaces)")
    return key


def route_path(scope) -> str:
    """The request's path inside this app (without the prefix it is mounted under)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path
