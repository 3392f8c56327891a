"""Errors of the serving layer: what the batching core and the request parser raise, and the
OpenAI-style JSON body each becomes.

Each error names its culprit in ``param`` ("input[3]", "encoding_format", ...) where there is one.
The HTTP status of each class is the app's business (`dice_fast.serve.app`); nothing here imports a
web framework.
"""

from __future__ import annotations

QUOTE_CHARS = 40  # the most an error message quotes of anything a client sent


def quote(text: str, most: int = QUOTE_CHARS) -> str:
    """``text`` cut to ``most`` characters (ending in "..." when cut): what an error may echo of it."""
    return text if len(text) <= most else text[: most - 3] + "..."


class ServeError(Exception):
    """Base of the errors a client can cause. message: for the client; param: the offending field."""

    type = "invalid_request_error"
    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict:
        """The OpenAI-shaped error object: ``{"error": {message, type, param, code}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(ServeError):
    """The request is malformed: not JSON, wrong types, an empty input, an unknown option (HTTP 400, as OpenAI answers it)."""


class UnsupportedMediaType(InvalidRequest):
    """The body is declared as something other than JSON in UTF-8 (HTTP 415)."""

    code = "unsupported_media_type"


class ModelNotFound(ServeError):
    """``GET /v1/models/{name}`` names a model this server does not serve (HTTP 404, ``param`` "model")."""

    code = "model_not_found"


class Unauthorized(ServeError):
    """No API key, or the wrong one (HTTP 401 with ``WWW-Authenticate: Bearer``)."""

    code = "invalid_api_key"


class RequestTooLarge(ServeError):
    """The request is over a size limit: too many bytes, inputs, characters or tokens (HTTP 413).
    Retrying will not help."""

    code = "request_too_large"


class Overloaded(ServeError):
    """The server is busy: too many tokens queued or too many requests at once (HTTP 429).

    retry_after: seconds after which a retry is likely to be admitted (at least 1).
    """

    type = "rate_limit_error"
    code = "overloaded"

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = max(1, int(retry_after))


class ShuttingDown(ServeError):
    """The encoder is closed or closing and takes no new requests (HTTP 503)."""

    type = "server_error"
    code = "shutting_down"


class OutOfMemory(ServeError):
    """One of the request's chunks ran out of memory even alone in its batch (HTTP 503): ``param`` names
    the input. The other requests of its batches were served; memory may be free again later."""

    type = "server_error"
    code = "out_of_memory"


class ModelOutputNotFinite(ServeError):
    """The model's output for one of the request's inputs holds NaN or an infinity (HTTP 500): ``param``
    names the input. A failure of the model (it overflows its precision), never sent as a vector."""

    type = "server_error"
    code = "non_finite_output"


class Unhealthy(ServeError):
    """The worker has stopped and the encoder cannot serve (HTTP 503, at once): restart the server."""

    type = "server_error"
    code = "unhealthy"


class DeadlineExceeded(ServeError):
    """The request took longer than ``request_timeout`` (HTTP 504); its chunks that had not run were
    dropped."""

    type = "server_error"
    code = "timeout"


def internal_error_body() -> dict:
    """The body of an unexpected server-side failure (HTTP 500); it never echoes internals."""
    return {"error": {"message": "internal error while encoding; see the server log", "type": "server_error",
                      "param": None, "code": "internal_error"}}


_LOGGED = "dice_fast_logged"


def log_once(log, exc: BaseException, message: str, *args) -> None:
    """Log ``message`` with ``exc``'s traceback and mark ``exc`` so (the worker, once for the batch it
    failed): the requests it fails log a line each (`was_logged`)."""
    log.error(message, *args, exc_info=exc)
    setattr(exc, _LOGGED, True)


def was_logged(exc: BaseException) -> bool:
    """Whether ``exc`` was logged with its traceback already: each request it failed needs one line, not
    the same traceback again (a batch shared by 64 requests wrote 65)."""
    return getattr(exc, _LOGGED, False)
