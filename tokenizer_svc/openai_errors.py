"""Errors of the OpenAI-compatible door: OpenAI's JSON shape, HTTP statuses from gRPC status codes.

Every failure of the pipeline is first a gRPC status, chosen by ``kvwire_serving.server.status_for`` (the
project's one exception -> status mapping); this module maps that status to HTTP once, with the
usual gRPC-HTTP table, so the HTTP and gRPC doors always agree on what went wrong.
"""
from __future__ import annotations

from typing import Any

import grpc

from kvwire_serving import server as serving

# gRPC status -> (HTTP status, OpenAI error type): the one mapping (the usual gRPC-HTTP table, but
# for FAILED_PRECONDITION).
_HTTP_BY_GRPC: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    # Reachable over HTTP only as prefill and decode disagreeing on model or KV layout (the door
    # refuses chat without a template itself): the deployment is broken, not the request.
    grpc.StatusCode.FAILED_PRECONDITION: (503, "server_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.ABORTED: (409, "server_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "invalid_request_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "invalid_request_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
    grpc.StatusCode.DATA_LOSS: (500, "server_error"),
    grpc.StatusCode.INTERNAL: (500, "server_error"),
}


class OpenAIError(Exception):
    """An error response: HTTP status plus OpenAI's ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @staticmethod
    def from_grpc(code: grpc.StatusCode, message: str, param: str | None = None) -> "OpenAIError":
        status, type_ = _HTTP_BY_GRPC.get(code, (500, "server_error"))
        return OpenAIError(status, message, type_, param, code.name.lower())

    @staticmethod
    def from_exception(exc: BaseException) -> "OpenAIError":
        """Any exception the pipeline raises, through kvwire's own gRPC mapping (``status_for``)."""
        if isinstance(exc, OpenAIError):
            return exc
        code, message = serving.status_for(exc)
        return OpenAIError.from_grpc(code, message)


def invalid(message: str, param: str | None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist; GET /v1/models lists the served model.",
                       "invalid_request_error", "model", "model_not_found")
