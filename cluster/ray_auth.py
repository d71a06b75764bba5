"""How pdserve's processes reach Ray safely: token authentication, and a local cluster on loopback only
(kept free of Ray imports where it can: Ray reads these settings once, at import).

Ray 2.60's `ray start` turns token authentication on, and a Ray cluster runs any code it is sent, so pdserve
keeps it on. A Ray head that pdserve starts itself gets a token made here when none is configured; a cluster
pdserve joins must already have one, which only its operator can hand out.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


class RayAuthError(RuntimeError):
    """No usable token: the message says, in one line, what to do."""


def use_ray_token_auth() -> None:
    """Drivers and dashboard clients must opt in to send the token. Call before Ray is imported; Ray reads
    its auth mode once, at import."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if "ray" in sys.modules:
        # Imported already (e.g. for its label validators): make this process re-read the mode.
        from ray import _raylet

        _raylet.Config.initialize("")  # type: ignore[attr-defined]


# Ray turns a loopback node address into the machine's own (so that other nodes could join) and then listens
# there: GCS, raylet, dashboard agent, and the Ray client server on port 10001. With this set to 0, a node
# keeps 127.0.0.1 and refuses to take in other nodes: what a one-machine cluster wants.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def use_loopback_ray() -> None:
    """For this process and the Ray processes it starts: the local cluster lives on 127.0.0.1 only. Also
    needed by a driver of such a cluster (it finds its node by that address)."""
    os.environ.update(LOOPBACK_ENV)
    if "ray" in sys.modules:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False


def token_path() -> Path:
    """Where Ray reads the token from when RAY_AUTH_TOKEN is unset (its own lookup order)."""
    explicit = os.environ.get(TOKEN_PATH_ENV)
    return Path(explicit).expanduser() if explicit else Path.home() / ".ray" / "auth_token"


def ensure_ray_token(*, create: bool) -> Path | None:
    """Make sure this process (and the Ray processes it starts) has a token; returns the file it made, if any.

    `create`: pdserve starts the Ray head itself, so a missing token is made here, 256 random bits in a file
    only its owner can read (`ray get-auth-token --generate` writes a world-readable one). Otherwise pdserve
    joins a running cluster, whose token must come from that cluster: a missing one is a RayAuthError.
    """
    if os.environ.get(TOKEN_ENV):
        return None
    path = token_path()
    if path.is_file() and path.read_text().strip():
        return None
    if not create:
        raise RayAuthError(
            f"no Ray auth token: copy the cluster's token (`ray get-auth-token` on its head) to {path}, "
            f"or set {TOKEN_ENV} or {TOKEN_PATH_ENV}"
        )
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.chmod(path, 0o600)  # O_CREAT's mode does not apply to a file that existed (empty)
    _forget_cached_token()
    return path


def _forget_cached_token() -> None:
    """Ray's token loader caches what it found (or that it found nothing) on first use."""
    if "ray" in sys.modules:
        from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]

        AuthenticationTokenLoader.instance().reset_cache()
