"""Admission and replica choice for each request, in front of the orchestrator.

Admission: requests are refused with RESOURCE_EXHAUSTED (never queued without bound) once the prompt
tokens admitted and not yet finished exceed `overload_queue_tokens`.
"""

from __future__ import annotations

from engine.messages import Sampling
from router.orchestrator import Route


class Overloaded(Exception):
    pass


class RequestRouter:
    def __init__(self, *, has_prefill_pool: bool, overload_queue_tokens: int) -> None:
        self._has_prefill = has_prefill_pool
        self._limit = overload_queue_tokens
        self._admitted: dict[str, int] = {}
        self._admitted_tokens = 0

    def route(self, request_id: str, session_id: str | None, prompt: list[int], sampling: Sampling) -> Route:
        if self._admitted and self._admitted_tokens + len(prompt) > self._limit:
            raise Overloaded(
                f"cluster overloaded: {self._admitted_tokens} prompt tokens in flight "
                f"(limit {self._limit}); retry later"
            )
        self._admitted[request_id] = len(prompt)
        self._admitted_tokens += len(prompt)
        return Route(prefill=self._has_prefill)

    def finish(self, request_id: str) -> None:
        self._admitted_tokens -= self._admitted.pop(request_id, 0)
