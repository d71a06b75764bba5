"""Ray token authentication for pdserve's processes (kept free of Ray imports: it must run first)."""

from __future__ import annotations

import os
import sys


def use_ray_token_auth() -> None:
    """Ray 2.60's `ray start` turns on token authentication (token in ~/.ray/auth_token); drivers and
    dashboard clients must opt in to send it. pdserve keeps it on: a Ray cluster runs code on request.
    Call before Ray is imported; Ray reads its auth mode once, at import."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if "ray" in sys.modules:
        # Imported already (e.g. for its label validators): make this process re-read the mode.
        from ray import _raylet

        _raylet.Config.initialize("")  # type: ignore[attr-defined]
