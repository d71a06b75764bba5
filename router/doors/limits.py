"""What either door accepts: one cap on a request's size, so a huge body costs neither door more than this
before it is refused (gRPC: RESOURCE_EXHAUSTED; HTTP: 413)."""

from __future__ import annotations

# gRPC's own default receive limit, set explicitly on the gRPC server and applied to HTTP bodies alike.
MAX_REQUEST_BYTES = 4 * 1024 * 1024
