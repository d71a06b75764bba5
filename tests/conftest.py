"""Test-session environment, set before anything imports Ray or vLLM."""

import os
import tempfile

# pdserve's clusters run with Ray token auth on (the default of `ray start` in Ray 2.60); a driver must opt in
# before Ray is imported, since Ray reads the mode once.
os.environ.setdefault("RAY_AUTH_MODE", "token")
# Keep the tests' run state and built model apart from a developer's own `pdserve up`.
os.environ.setdefault("PDSERVE_CACHE_DIR", tempfile.mkdtemp(prefix="pdserve-tests-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
