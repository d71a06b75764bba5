"""The module-scoped real cluster the serving tests share (engines start once per module: ~80 s)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e_support import RunningCluster, cluster_up, make_topology
from ports import free_port


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    # Every request takes the prefill -> NIXL -> decode path: these tests are about that path, so the
    # router's local prefills (tested in test_kv_routing.py) are off.
    topology = make_topology(
        tmp_path_factory.mktemp("topology"),
        router__mode="disaggregate",
        server__http_port=free_port(),  # the OpenAI HTTP door too
    )
    with cluster_up(topology) as running:
        yield running
