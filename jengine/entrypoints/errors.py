"""OpenAI-style error bodies (`{"error": {"message", "type", "param", "code"}}`) and their HTTP status."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from jengine.async_llm import EngineDeadError
from jengine.entrypoints import protocol

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
          413: "RequestTooLarge", 422: "UnprocessableEntityError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | int | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.type = type or _TYPES.get(status, "InternalServerError")
        self.param = param
        self.code = code if code is not None else status

    @classmethod
    def from_exception(cls, e: BaseException) -> APIError:
        if isinstance(e, APIError):
            return e
        if isinstance(e, ValueError):
            return cls(400, str(e), param=named_param(str(e)))
        if isinstance(e, EngineDeadError):
            return cls(503, str(e))
        return cls(500, f"internal error: {type(e).__name__}: {e}")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


_REQUEST_FIELDS = frozenset().union(*(m.model_fields for m in (
    protocol.CompletionRequest, protocol.ChatCompletionRequest, protocol.TokenizeRequest,
    protocol.DetokenizeRequest, protocol.EmbeddingRequest)))
_LEADING_NAME = re.compile(r"[a-z_]+")


def named_param(message: str) -> str | None:
    """The request field a validation message is about, when it starts with one ("top_p must be in (0, 1],
    got 2" -> "top_p"): the error body's `param`, as OpenAI's API fills it."""
    match = _LEADING_NAME.match(message)
    return match.group(0) if match and match.group(0) in _REQUEST_FIELDS else None


def validation_message(errors) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, and the first offending field."""
    parts, param = [], None
    for err in list(errors)[:5]:
        if err.get("type") == "json_invalid":
            return "the request body is not valid JSON", None
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = ".".join(loc)
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request", param
