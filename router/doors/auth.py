"""The bearer-token check both doors share (topology `server.auth_token_env`: the token's value is never
logged). Compared in constant time."""

from __future__ import annotations

import hmac


class BearerToken:
    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def allows(self, authorization: str | bytes) -> bool:
        """Whether an `authorization` header value is `Bearer <the token>`."""
        if isinstance(authorization, bytes):
            authorization = authorization.decode(errors="replace")
        scheme, _, sent = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(sent.encode(), self._token)
