"""The module-scoped real cluster the serving tests share (engines start once per module: ~80 s)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e_support import RunningCluster, make_topology


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    running = RunningCluster(make_topology(tmp_path_factory.mktemp("topology")))
    try:
        running.wait_ready()
        yield running
    finally:
        if running.proc.poll() is None:
            running.down()
