"""How a request can fail inside the router, each with the status a client sees.

The doors map `RequestFailed` to a gRPC status or an OpenAI error; the stages raise the narrower ones and the
request path (router/generate.py) turns them into `RequestFailed`.
"""

from __future__ import annotations

import grpc


class RequestFailed(Exception):
    """How a request ends when it does not succeed: a documented gRPC status and a message fit for a client
    (the HTTP door maps both to OpenAI's error shape)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class NoReplicaError(Exception):
    """No ready replica can serve the request, or none could finish it (UNAVAILABLE; the message is safe to
    show a client)."""


class Overloaded(Exception):
    """Admission refused: the cluster has too many prompt tokens in flight (RESOURCE_EXHAUSTED)."""


class ClientNotReading(Exception):
    """The client left too much of its stream unread; the request was ended and its engine request aborted
    (RESOURCE_EXHAUSTED)."""
