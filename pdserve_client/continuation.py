"""A Generate stream that outlives the router serving it.

When the connection to a router is lost mid-stream (UNAVAILABLE after the router answered: it died, or is
being replaced), the SDK reconnects to the same address (Serve replaces a router, or another one shares its
port) and sends the continuation the router's own engine failover uses: the original prompt plus every
token already received, with what is left of max_tokens. A greedy stream so goes on exactly where it
stopped; the final message says it moved and counts the request as one.

A stream no router answered yet fails at once, as any call does (nothing serves the address, TLS fails, or
the router died before its first message: the client may send it again). Not continued once output began:
requests with tools or a response format (the router's tool-call parser and the engine's grammar would start
over after what the client already has), and requests without max_tokens (what is left of the server's
default is not known here); their error says so. A stop string that spans the break is not seen (each
router sees only its own part of the output).
"""

from __future__ import annotations

import time

import grpc

from pdserve_client.api import pdserve_pb2 as pb

# How long a stream keeps trying to reach a router again, by default (Serve restarts a dead router's
# replica in ~10-20 s on a small machine: its health check, then the tokenizer's load).
RECONNECT_S = 60.0
# Channel options: try a lost connection again within a second, not after gRPC's default backoff (to 120 s).
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]
MAX_MOVES = 4


class StreamContinuation:
    """One Generate stream's state across routers: what was received, and the next request to send."""

    def __init__(self, request: pb.GenerateRequest, reconnect_s: float = RECONNECT_S) -> None:
        self.request = request
        self.reconnect_s = reconnect_s
        self._received: list[int] = []
        self._prompt_ids: list[int] | None = list(request.prompt_token_ids) or None
        self._moves: list[str] = []
        self._lost_at: float | None = None
        # A router answered this stream: it was accepted, so a lost connection is a lost router, not an
        # address nothing serves or a TLS handshake that fails (those fail at once, as before).
        self._answered = False

    @property
    def moved(self) -> bool:
        return bool(self._moves)

    def seen(self, response: pb.GenerateResponse) -> pb.GenerateResponse:
        """Record a response on its way to the caller; a moved stream's final message is made the whole
        request's (its prompt, every token, a note)."""
        self._received.extend(response.token_ids)
        self._answered = True
        self._lost_at = None
        if self._moves and response.HasField("final"):
            usage = response.final.usage
            if self._prompt_ids is not None:
                usage.prompt_tokens = len(self._prompt_ids)
                usage.cached_tokens = min(usage.cached_tokens, len(self._prompt_ids))
            usage.completion_tokens = len(self._received)
            notes = [response.final.served_by.note, *self._moves]
            response.final.served_by.note = "; ".join(n for n in notes if n)
        return response

    def may_continue(self, error: grpc.RpcError) -> float | None:
        """After `error` ended the stream: the seconds to wait before sending the continuation, or None if
        the error is the request's own (not a lost router) or the stream cannot go on."""
        code = error.code() if callable(getattr(error, "code", None)) else None
        if code != grpc.StatusCode.UNAVAILABLE or self.reconnect_s <= 0 or len(self._moves) >= MAX_MOVES:
            return None
        if not self._answered:
            return None
        if self.cannot_continue():
            return None
        now = time.monotonic()
        if self._lost_at is None:
            self._lost_at = now
        elif now - self._lost_at > self.reconnect_s:
            return None
        return min(0.1 * 2 ** len(self._moves), 1.0)

    def cannot_continue(self) -> str:
        """Why this stream, once its output began, cannot be continued elsewhere ("" if it can)."""
        if not self._received:
            return ""
        r = self.request
        if r.tools or r.HasField("response_format"):
            return "a request with tools or a response format cannot continue once its output has begun"
        if not r.sampling.HasField("max_tokens"):
            return (
                "a request without max_tokens cannot continue (what is left of the default is unknown here)"
            )
        return ""

    def reconnect_left_s(self) -> float:
        return max(self.reconnect_s - (time.monotonic() - (self._lost_at or time.monotonic())), 0.1)

    def needs_prompt_ids(self) -> bool:
        """True until the prompt's token ids are known (a text or chat prompt: the router tokenizes it)."""
        return self._prompt_ids is None and bool(self._received)

    def tokenize_request(self) -> pb.TokenizeRequest:
        r = self.request
        return pb.TokenizeRequest(
            model=r.model,
            prompt=r.prompt,
            messages=r.messages,
            tools=r.tools,
            chat_template_kwargs_json=r.chat_template_kwargs_json,
        )

    def continue_with(self, prompt_ids: list[int] | None, error: grpc.RpcError) -> pb.GenerateRequest:
        """The next request: the original one again if nothing was received yet, else its continuation."""
        details = error.details() if callable(getattr(error, "details", None)) else ""
        if not self._received:
            self._moves.append(f"sent again after the router connection was lost ({details})")
            return self.request
        if self._prompt_ids is None:
            assert prompt_ids is not None, "a continuation of a text or chat prompt needs its token ids"
            self._prompt_ids = prompt_ids
        self._moves.append(
            f"continued after {len(self._received)} tokens: the router connection was lost ({details})"[:500]
        )
        r = self.request
        sampling = pb.SamplingParams()
        sampling.CopyFrom(r.sampling)
        sampling.max_tokens = max(r.sampling.max_tokens - len(self._received), 1)
        return pb.GenerateRequest(
            model=r.model,
            prompt_token_ids=self._prompt_ids + self._received,
            sampling=sampling,
            session_id=r.session_id,
            request_id=f"{r.request_id}.{len(self._moves)}" if r.request_id else "",
        )
