"""What the web app adds to Gradio's server: a Content-Security-Policy on every response, a
back-off on failed logins, and the login on Gradio's /cancel and /reset routes. No Gradio here
(Starlette only); app.py passes the middleware to `demo.launch(app_kwargs={"middleware": ...})`.

NOTE: the login check reads three attributes of Gradio's `App` (`auth`, `tokens`, and
`cookie_id`, which names the session cookie), as gradio/routes.py's own `get_current_user` does;
tests/test_app_flows.py checks it against the running server.
"""
from __future__ import annotations

import hmac
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse

# Everything from this origin only: Gradio serves its scripts, styles, fonts and API itself.
# Inline scripts and eval stay allowed (Gradio's page config and `js=` events use them).
CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'self'",
    "script-src 'self' 'unsafe-inline' 'unsafe-eval'",
    "style-src 'self' 'unsafe-inline'",
    "img-src 'self' data: blob:",
    "font-src 'self' data:",
    "connect-src 'self'",
    "media-src 'self' data: blob:",
    "worker-src 'self' blob:",
    "frame-src 'self'",
    "object-src 'none'",
    "base-uri 'self'",
    "form-action 'self'",
    "frame-ancestors 'self'",
])
LOGIN_REQUIRED = ("/gradio_api/cancel", "/gradio_api/reset")  # Gradio leaves these open


def password_check(password: str) -> Callable[[str, str], bool]:
    """Gradio's `auth` callable: any user name, `password` compared in constant time."""
    expected = password.encode()
    return lambda _user, given: hmac.compare_digest(given.encode(), expected)


@dataclass
class LoginThrottle:
    """Failed logins per client address. The first `free_tries` failures within `window`
    seconds cost nothing; after that each try must wait `base_delay * 2**k` seconds (k: the
    failures beyond the free ones, minus one; at most `max_delay`) after the last failure.
    A success, or `window` seconds without a failure, forgets the address."""

    free_tries: int = 5
    window: float = 900.0
    base_delay: float = 2.0
    max_delay: float = 900.0
    clock: Callable[[], float] = time.monotonic
    _failures: dict[str, tuple[int, float]] = field(default_factory=dict)  # address -> (count, last time)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def wait(self, client: str) -> float:
        """Seconds before `client` may try again (0.0: now)."""
        with self._lock:
            count, last = self._current(client)
        if count < self.free_tries:
            return 0.0
        delay = min(self.max_delay, self.base_delay * 2 ** (count - self.free_tries))
        return max(0.0, last + delay - self.clock())

    def failed(self, client: str) -> None:
        now = self.clock()
        with self._lock:
            count, _ = self._current(client)
            self._failures[client] = (count + 1, now)
            for address in [a for a, (_, last) in self._failures.items() if now - last > self.window]:
                del self._failures[address]

    def succeeded(self, client: str) -> None:
        with self._lock:
            self._failures.pop(client, None)

    def _current(self, client: str) -> tuple[int, float]:
        count, last = self._failures.get(client, (0, 0.0))
        return (count, last) if count and self.clock() - last <= self.window else (0, 0.0)


def login_message(throttle: LoginThrottle) -> str:
    """What the login page says above the form. Gradio's page shows an error only for a 400
    (wrong password) and nothing for the throttle's 429, so the wait is explained up front."""
    return (f"Spotlight Chat: any user name, the server's password. After {throttle.free_tries} wrong passwords "
            f"the next try must wait {throttle.base_delay:g} s, then twice as long after each wrong one; "
            f"if Login seems to do nothing, wait a little and try again.")


def too_many_logins(seconds: float) -> str:
    return f"Too many wrong passwords from this address: wait {math.ceil(seconds)} s, then try again."


class GuardMiddleware:
    """ASGI middleware: adds the CSP header, throttles POST .../login, and answers 401 on
    Gradio's cancel/reset routes without a login (when the app has a password)."""

    def __init__(self, app, throttle: LoginThrottle | None = None):
        self.app = app
        self.throttle = throttle or LoginThrottle()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"].rstrip("/")
        if scope["method"] == "POST" and path.endswith("/login"):
            return await self._login(scope, receive, send)
        if path.endswith(LOGIN_REQUIRED) and not logged_in(scope):
            response = JSONResponse({"detail": "Not authenticated: log in first."}, status_code=401)
            return await response(scope, receive, self._with_csp(send))
        await self.app(scope, receive, self._with_csp(send))

    async def _login(self, scope, receive, send):
        client = (scope.get("client") or ("unknown",))[0]
        if wait := self.throttle.wait(client):
            response = JSONResponse({"detail": too_many_logins(wait)}, status_code=429,
                                    headers={"Retry-After": str(math.ceil(wait))})
            return await response(scope, receive, self._with_csp(send))
        status = []

        async def watched(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        await self.app(scope, receive, self._with_csp(watched))
        if status and status[0] == 200:
            self.throttle.succeeded(client)
        elif status and 400 <= status[0] < 500:
            self.throttle.failed(client)

    @staticmethod
    def _with_csp(send):
        async def sending(message):
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).setdefault("Content-Security-Policy", CONTENT_SECURITY_POLICY)
            await send(message)
        return sending


def logged_in(scope) -> bool:
    """Whether the request carries a login session of the Gradio app (True when it has no password)."""
    app = scope.get("app")
    if getattr(app, "auth", None) is None:
        return True
    cookies = Request(scope).cookies
    token = cookies.get(f"access-token-{app.cookie_id}") or cookies.get(f"access-token-unsecure-{app.cookie_id}")
    return token is not None and token in app.tokens


def middleware(throttle: LoginThrottle | None = None) -> list[Middleware]:
    """The middleware list for `demo.launch(app_kwargs={"middleware": ...})`."""
    return [Middleware(GuardMiddleware, throttle=throttle)]
