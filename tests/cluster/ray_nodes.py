"""Labelled Ray nodes on this one host (ray.cluster_utils.Cluster), started and stopped by a helper process.

Why a helper process: Ray starts each node's daemons with fork() and a Python `preexec_fn`. Once a test
process has run a cluster it has live threads (Ray's driver, gRPC servers and channels); a fork from such a
process can leave the child deadlocked or aborted before it execs, which CI saw as "The current node timed
out during startup" and "Failed to start the dashboard, return code -6". The helper is a fresh interpreter
(multiprocessing "spawn") that does nothing but start and stop nodes, so its forks are safe. The test process
still connects to the cluster as a driver (`ray.init(address=nodes.address)`).
"""

from __future__ import annotations

import multiprocessing
import traceback
from multiprocessing.connection import Connection
from typing import Any

# Starting a node waits up to Ray's own 30 s for the raylet to register; removing one waits for its processes.
REPLY_TIMEOUT_S = 120.0


def _serve(conn: Connection, head_args: dict[str, Any]) -> None:
    """The helper's loop: one command at a time, each answered ("ok", value) or ("error", traceback)."""
    from ray.cluster_utils import Cluster

    cluster = None
    nodes: dict[str, Any] = {}
    try:
        cluster = Cluster(initialize_head=True, head_node_args=head_args)
        conn.send(("ok", (cluster.address, cluster.head_node.node_id)))
        while True:
            command, args = conn.recv()
            try:
                if command == "add":
                    node = cluster.add_node(**args)
                    nodes[node.node_id] = node
                    reply: Any = node.node_id
                elif command == "remove":
                    cluster.remove_node(nodes.pop(args))
                    reply = None
                elif command == "wait":
                    cluster.wait_for_nodes()
                    reply = None
                elif command == "shutdown":
                    cluster.shutdown()
                    cluster = None
                    conn.send(("ok", None))
                    return
                else:
                    raise ValueError(f"unknown command {command!r}")
            except Exception:  # reported to the test process, which raises it
                conn.send(("error", traceback.format_exc()))
                continue
            conn.send(("ok", reply))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        if cluster is not None:
            cluster.shutdown()


class RayNodes:
    """A head node (with `head_args`) and the worker nodes added later, all owned by one helper process."""

    def __init__(self, head_args: dict[str, Any]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, head_args), name="ray-nodes", daemon=True)
        self._process.start()
        child.close()
        try:
            self.address, self.head_node_id = self._reply("start the head node")
        except BaseException:
            self._process.kill()
            raise

    def _reply(self, what: str) -> Any:
        if not self._conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"ray-nodes helper did not {what} within {REPLY_TIMEOUT_S:.0f} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"ray-nodes helper failed to {what}:\n{value}")
        return value

    def _call(self, command: str, args: Any, what: str) -> Any:
        self._conn.send((command, args))
        return self._reply(what)

    def add_node(self, **node_args: Any) -> str:
        """Start a worker node; returns its node id (hex)."""
        return str(self._call("add", node_args, "add a node"))

    def remove_node(self, node_id: str) -> None:
        """Kill every process of a worker node (what losing the machine looks like to Ray)."""
        self._call("remove", node_id, f"remove node {node_id}")

    def wait_for_nodes(self) -> None:
        self._call("wait", None, "see every node registered")

    def shutdown(self) -> None:
        try:
            if self._process.is_alive():
                self._call("shutdown", None, "shut the cluster down")
        finally:
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.kill()
            self._conn.close()
