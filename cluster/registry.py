"""The replica registry: the Serve application's ingress deployment, where every engine replica publishes
what the router needs (role, replica id, node, KV-events endpoint, NIXL side channel, readiness).

Replicas publish on start and then heartbeat; an entry that stops being refreshed (the replica died or
its node is gone) expires, and a replica withdraws itself on graceful shutdown. The registry holds no
state that cannot be rebuilt: if Serve restarts it, the next heartbeats repopulate it.
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve.handle import DeploymentHandle

from engine.messages import ReplicaInfo

HEARTBEAT_S = 2.0
EXPIRY_S = 10.0


class Registry:
    # The engine deployments are bound here only so that Serve deploys them as part of this
    # application; the router reaches them by name.
    def __init__(self, *engine_pools: DeploymentHandle) -> None:
        self._entries: dict[str, tuple[ReplicaInfo, float]] = {}

    def reconfigure(self, config: dict[str, Any]) -> None:
        """Serve calls this with the deployment's user_config: the deployed topology. The registry only
        carries it, so that Serve's deployed config holds it for `pdserve apply` to read back
        (cluster/serve_config.py); a deployment with a user_config must have this method."""

    def publish(self, info: ReplicaInfo) -> None:
        self._entries[info.replica_id] = (info, time.monotonic())

    def withdraw(self, replica_id: str) -> None:
        self._entries.pop(replica_id, None)

    def snapshot(self) -> list[ReplicaInfo]:
        now = time.monotonic()
        expired = [rid for rid, (_, seen) in self._entries.items() if now - seen > EXPIRY_S]
        for rid in expired:
            del self._entries[rid]
        return [info for info, _ in self._entries.values()]
