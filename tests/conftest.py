"""Test-session environment, set before anything imports Ray or vLLM; and how the session leaves."""

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.ray_auth import TOKEN_PATH_ENV, ensure_ray_token

# pdserve's clusters run with Ray token auth on (the default of `ray start` in Ray 2.60); a driver must opt in
# before Ray is imported, since Ray reads the mode once.
os.environ.setdefault("RAY_AUTH_MODE", "token")
# Keep the tests' run state and built model apart from a developer's own `pdserve up`.
os.environ.setdefault("PDSERVE_CACHE_DIR", tempfile.mkdtemp(prefix="pdserve-tests-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The Ray clusters the tests start share one token of their own, made as `pdserve up` makes one, so the suite
# neither needs nor touches a ~/.ray/auth_token (tests/e2e/test_fresh_machine.py runs without any).
if "RAY_AUTH_TOKEN" not in os.environ and TOKEN_PATH_ENV not in os.environ:
    os.environ[TOKEN_PATH_ENV] = str(Path(os.environ["PDSERVE_CACHE_DIR"]) / "ray" / "auth_token")
    ensure_ray_token(create=True)

_EXIT_STATUS = pytest.StashKey[int]()


@pytest.fixture(autouse=True)
def _close_token_channels() -> Iterator[None]:
    """The token channels a test's stand-in decode pool opened (tests/decode_pool.py)."""
    yield
    decode_pool = sys.modules.get("decode_pool")
    if decode_pool is not None:
        decode_pool.close_all()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


# Native runtimes whose threads outlive the tests (see pytest_unconfigure).
_NATIVE_RUNTIMES = ("torch", "vllm", "ray._raylet")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """After a run that loaded torch/vLLM or Ray's core worker into this process, leave with pytest's exit
    status without finalizing the interpreter. Their native threads (torch's OpenMP pool, the core worker's
    gRPC and event threads) are still running when Python tears modules down, and finalization can crash:
    one CI-equivalent run printed "464 passed" and then exited 139 (segmentation fault), while the other full
    runs, a rerun of that commit among them, exited 0. Not reproduced on demand, so not found; runs that load
    none of them (the policy, replay and most router tests) finalize normally, atexit handlers included."""
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None or not any(name in sys.modules for name in _NATIVE_RUNTIMES):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
