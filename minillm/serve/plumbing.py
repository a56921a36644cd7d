# Generated from notebooks/18_server.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""The server's plumbing: the in-flight limit (429) and errors as OpenAI's JSON, always.

Built in notebooks/18_server.ipynb (its Plumbing section): `InFlight`, and `as_api_error`, the one rule that
turns any exception into the error a client gets, which `add_error_handlers` registers on an app.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from minillm.serve.openai_protocol import APIError
from minillm.serve.ops import Refusal
from minillm.utils.validate import is_positive_int


class InFlight:
    """Requests from their arrival (before the body is read) to their end; past `limit`, a new one is
    refused (429). `enter` returns the request's `release`, safe to call more than once."""

    def __init__(self, limit: int):
        if not is_positive_int(limit):
            raise ValueError(f"max_in_flight must be an int >= 1, got {limit!r}")
        self.limit, self.count = limit, 0
        self.lock = threading.RLock()  # a release may come from a finalizer: another thread, or a GC inside enter()

    def enter(self) -> Callable[[], None]:
        with self.lock:
            if self.count >= self.limit:
                raise APIError(429, f"{self.limit} requests are in flight; retry later", None, "too_many_requests",
                               {"Retry-After": "1"})
            self.count += 1
        released = []

        def release() -> None:
            with self.lock:
                if not released:
                    released.append(True)
                    self.count -= 1
        return release


def as_api_error(exc: Exception) -> APIError:
    """What the client gets: an APIError as it is, the gate's Refusal with its status, a ValueError (the
    engine's check) as a 400, anything else (a bug) as a 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, Refusal):
        return APIError(exc.status, exc.message, None, exc.code, exc.headers)
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error")


async def on_api_error(request, exc: APIError | Refusal):
    return as_api_error(exc).response()


async def on_http_error(request, exc):  # unknown paths, wrong methods
    return APIError(exc.status_code, str(exc.detail)).response()


async def on_unexpected_error(request, exc):  # a bug outside the completions: still OpenAI's JSON
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error").response()


def add_error_handlers(app: FastAPI) -> None:
    """Every failure answers with OpenAI's error JSON: our APIErrors and the gate's refusals, the
    framework's 404 and 405, and bugs."""
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(Refusal, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected_error)
