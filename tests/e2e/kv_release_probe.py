"""Run as a subprocess against a running local cluster (its RunState): a prefill leg whose decode never comes,
then the decode replica's `release`. Prints one JSON line: the prefill engine's KV usage while the KV waits to
be pulled, and how long after `release` it reached zero. Own process: the test process stays off Ray."""

import json
import logging
import sys
import time

from cluster.ray_auth import use_loopback_ray, use_ray_token_auth

use_ray_token_auth()  # before Ray is imported: it reads its auth mode once

import ray  # noqa: E402
from ray import serve  # noqa: E402

from cluster.bootstrap import APP_NAME, RunState  # noqa: E402
from engine.messages import EngineRequest, Sampling  # noqa: E402

HELD_S = 3.0  # the KV must stay held this long without a release (vLLM's lease is 30 s)
FREED_WITHIN_S = 10.0


def usage(prefill: object) -> float:
    return float(prefill.stats.remote().result(timeout_s=10).kv_cache_usage)  # type: ignore[attr-defined]


def main() -> None:
    state = RunState.load()
    assert state is not None, "no running cluster"
    use_loopback_ray()
    ray.init(address=state.ray_address, namespace="pdserve", log_to_driver=False, logging_level=logging.ERROR)
    prefill = serve.get_deployment_handle("prefill", APP_NAME)
    decode = serve.get_deployment_handle("decode", APP_NAME)
    prompt = [(7 * i) % 900 + 5 for i in range(int(sys.argv[1]))]
    req = EngineRequest(request_id=f"probe-{time.time_ns()}-p", prompt_token_ids=prompt, sampling=Sampling())
    result = prefill.prefill.remote(req).result(timeout_s=120)
    held = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < HELD_S:
        held.append(usage(prefill))
        time.sleep(0.25)
    released = decode.release.remote(result.kv_transfer_params).result(timeout_s=30)
    t1 = time.monotonic()
    freed_after = None
    while time.monotonic() - t1 < FREED_WITHIN_S:
        if usage(prefill) == 0.0:
            freed_after = time.monotonic() - t1
            break
        time.sleep(0.1)
    again = decode.release.remote(result.kv_transfer_params).result(timeout_s=30)
    found = {"held_min": min(held), "released": released, "freed_after_s": freed_after, "again": again}
    print("PROBE " + json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
