"""Wait for a Serve application's replicas to be placed, and say exactly why when they are not.

An unplaceable Serve deployment never fails: it stays DEPLOYING while its replicas' placement groups stay
PENDING. `wait_for_placement` polls what the Ray dashboard already knows (Serve's application status and
Ray's state API for placement groups and nodes) and returns before its timeout with, per pool, which
replicas are placed on which nodes, and for the others what they asked for and why Ray cannot place them:
INFEASIBLE (no labelled node, or set of nodes, could ever hold them) or NO_RESOURCES (they fit, but the
resources are taken). It reads over HTTP in worker threads, so it never blocks the event loop, and every
request has a deadline, so it never hangs.

Serve names each replica's placement group like its actor, `SERVE_REPLICA::<app>#<deployment>#<id>`; that
name ties Ray's placement groups to Serve's pools, as in the dashboard's Serve and placement-group views.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Sequence
from typing import Any

import msgspec
from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]

from cluster.topology import Topology, selector_matches

INFEASIBLE = "INFEASIBLE"
NO_RESOURCES = "NO_RESOURCES"


class PlacementSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one pool's replicas ask Ray for (as compiled into the Serve config)."""

    deployment: str
    replicas: int
    bundles: list[dict[str, float]]
    label_selector: dict[str, str] = {}
    nodes_per_replica: int = 1


def placement_specs(topo: Topology) -> list[PlacementSpec]:
    """The placement of every pool that has replicas, named like its Serve deployment."""
    return [
        PlacementSpec(
            deployment=role,
            replicas=pool.replicas,
            bundles=pool.bundles(),
            label_selector=dict(pool.node_labels),
            nodes_per_replica=pool.nodes_per_replica,
        )
        for role, pool in topo.pools.items()
        if pool.replicas > 0
    ]


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    ip: str
    labels: dict[str, str]
    gpus: float
    alive: bool


class ReplicaPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """One replica's placement group as Ray's state API shows it."""

    placement_group: str  # its name: SERVE_REPLICA::<app>#<deployment>#<id>
    placement_group_id: str
    state: str  # PENDING | CREATED | RESCHEDULING
    scheduling_state: str | None  # NO_RESOURCES | INFEASIBLE | FINISHED | ... (Ray's scheduling stats)
    bundle_nodes: list[str | None]  # the node of each bundle, in bundle order (None: not placed)

    @property
    def placed(self) -> bool:
        return self.state == "CREATED"

    @property
    def nodes(self) -> list[str]:
        """Distinct nodes holding its bundles, bundle 0's node first."""
        return list(dict.fromkeys(n for n in self.bundle_nodes if n))


class PoolPlacement(msgspec.Struct, frozen=True, kw_only=True):
    spec: PlacementSpec
    serve_status: str | None  # Serve's deployment status (None: Serve does not show it yet)
    serve_message: str  # after ~30 s of waiting Serve names the missing resources here
    replicas: list[ReplicaPlacement]
    problems: list[str]  # placed, but not as asked (wrong labels, more nodes than nodes_per_replica)

    @property
    def placed_replicas(self) -> int:
        return sum(r.placed for r in self.replicas)

    @property
    def placed(self) -> bool:
        return self.placed_replicas >= self.spec.replicas

    @property
    def reason(self) -> str | None:
        """Why it is not placed: INFEASIBLE, NO_RESOURCES, or whatever Ray/Serve says; None when placed."""
        if self.placed:
            return None
        states = {r.scheduling_state for r in self.replicas if not r.placed}
        for known in (INFEASIBLE, NO_RESOURCES):
            if known in states:
                return known
        if not self.replicas:
            return "WAITING_FOR_SERVE"  # Serve has not asked Ray for its placement groups yet
        return next((s for s in states if s), "PENDING")


class PlacementReport(msgspec.Struct, frozen=True, kw_only=True):
    app_name: str
    elapsed_s: float
    timed_out: bool
    app_status: str | None
    app_message: str
    pools: list[PoolPlacement]
    nodes: dict[str, NodeInfo]
    errors: list[str]  # dashboard requests that failed on the last poll

    @property
    def placed(self) -> bool:
        return all(p.placed for p in self.pools)

    @property
    def ok(self) -> bool:
        return self.placed and not any(p.problems for p in self.pools)

    def pending(self) -> list[PoolPlacement]:
        return [p for p in self.pools if not p.placed]

    def summary(self) -> str:
        """A few lines for an operator: each pool, its replicas' nodes, and why what waits is waiting."""
        head = (
            "placed" if self.placed else "NOT placed: " + ", ".join(p.spec.deployment for p in self.pending())
        )
        lines = [
            f"{self.app_name}: {head} after {self.elapsed_s:.1f} s (Serve: {self.app_status or 'unknown'})"
        ]
        for pool in self.pools:
            spec = pool.spec
            status = f"{pool.placed_replicas}/{spec.replicas} replicas placed"
            lines.append(f"  {spec.deployment}: {status} (Serve: {pool.serve_status or 'unknown'})")
            for replica in pool.replicas:
                where = ", ".join(self._node_name(n) for n in replica.nodes) or "no node"
                lines.append(f"    {replica.placement_group}: {replica.state} on {where}")
            if not pool.placed:
                lines.append(f"    waiting: {pool.reason}: asks {describe_ask(spec)}")
                if pool.serve_message:
                    lines.append(f"    Serve says: {pool.serve_message}")
            lines.extend(f"    problem: {problem}" for problem in pool.problems)
        lines.extend(f"  dashboard: {error}" for error in self.errors)
        return "\n".join(lines)

    def _node_name(self, node_id: str) -> str:
        node = self.nodes.get(node_id)
        if node is None:
            return node_id[:8]
        labels = ",".join(f"{k}={v}" for k, v in node.labels.items() if not k.startswith("ray.io/"))
        return f"{node_id[:8]} ({node.ip} {labels})"


def describe_ask(spec: PlacementSpec) -> str:
    """E.g. '16 bundles (GPU 16, CPU 24) over 2 nodes labelled {role: decode}' per replica."""
    totals: dict[str, float] = {}
    for bundle in spec.bundles:
        for resource, amount in bundle.items():
            totals[resource] = totals.get(resource, 0.0) + amount
    resources = ", ".join(f"{k} {v:g}" for k, v in totals.items())
    where = f" over {spec.nodes_per_replica} nodes" if spec.nodes_per_replica > 1 else " on one node"
    labels = ", ".join(f"{k}: {v}" for k, v in spec.label_selector.items())
    selector = f" labelled {{{labels}}}" if labels else ""
    return f"{len(spec.bundles)} bundles ({resources}){where}{selector} per replica, x{spec.replicas}"


async def wait_for_placement(
    app_name: str,
    deployments: Sequence[PlacementSpec],
    timeout_s: float,
    dashboard_url: str,
    *,
    poll_s: float = 1.0,
    infeasible_grace_s: float = 10.0,
) -> PlacementReport:
    """Poll until every deployment's replicas are placed, the application failed, or `timeout_s` passed.

    Returns early too when everything still pending has been INFEASIBLE for `infeasible_grace_s`: on a
    fixed cluster that never resolves (an autoscaler could add nodes, hence the grace).
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + timeout_s
    infeasible_since: float | None = None
    headers = await asyncio.to_thread(_auth_headers)
    while True:
        remaining = max(0.0, deadline - loop.time())
        report = await _observe(
            app_name, deployments, dashboard_url, headers, loop.time() - start, min(5.0, remaining)
        )
        now = loop.time()
        report = msgspec.structs.replace(report, elapsed_s=now - start)
        if report.placed or report.app_status == "DEPLOY_FAILED":
            return report
        if all(p.reason == INFEASIBLE for p in report.pending()):
            infeasible_since = now if infeasible_since is None else infeasible_since
            if now - infeasible_since >= infeasible_grace_s:
                return report
        else:
            infeasible_since = None
        if now >= deadline:
            return msgspec.structs.replace(report, timed_out=True)
        await asyncio.sleep(min(poll_s, deadline - now))


async def _observe(
    app_name: str,
    specs: Sequence[PlacementSpec],
    dashboard_url: str,
    headers: dict[str, str],
    elapsed_s: float,
    request_timeout_s: float,
) -> PlacementReport:
    errors: list[str] = []
    timeout = max(request_timeout_s, 0.1)
    serve, groups, nodes = await asyncio.gather(
        _get_json(f"{dashboard_url}/api/serve/applications/", headers, timeout, errors),
        _get_json(f"{dashboard_url}/api/v0/placement_groups?detail=1&limit=10000", headers, timeout, errors),
        _get_json(f"{dashboard_url}/api/v0/nodes?detail=1&limit=10000", headers, timeout, errors),
    )
    app = ((serve or {}).get("applications") or {}).get(app_name) or {}
    node_infos = {n.node_id: n for n in (_node_info(raw) for raw in _state_rows(nodes))}
    pg_rows = [row for row in _state_rows(groups) if row.get("state") != "REMOVED"]
    pools = [_pool_placement(app_name, spec, app, pg_rows, node_infos) for spec in specs]
    return PlacementReport(
        app_name=app_name,
        elapsed_s=elapsed_s,
        timed_out=False,
        app_status=app.get("status"),
        app_message=app.get("message") or "",
        pools=pools,
        nodes=node_infos,
        errors=errors,
    )


def _pool_placement(
    app_name: str,
    spec: PlacementSpec,
    app: dict[str, Any],
    pg_rows: list[dict[str, Any]],
    nodes: dict[str, NodeInfo],
) -> PoolPlacement:
    prefix = f"SERVE_REPLICA::{app_name}#{spec.deployment}#"
    replicas = [_replica(row) for row in pg_rows if str(row.get("name", "")).startswith(prefix)]
    deployment = (app.get("deployments") or {}).get(spec.deployment) or {}
    return PoolPlacement(
        spec=spec,
        serve_status=deployment.get("status"),
        serve_message=deployment.get("message") or "",
        replicas=sorted(replicas, key=lambda r: r.placement_group),
        problems=[p for r in replicas if r.placed for p in _problems(spec, r, nodes)],
    )


def _replica(row: dict[str, Any]) -> ReplicaPlacement:
    bundles = sorted(row.get("bundles") or [], key=lambda b: b.get("bundle_id", {}).get("bundle_index", 0))
    stats = row.get("stats") or {}
    return ReplicaPlacement(
        placement_group=str(row.get("name", "")),
        placement_group_id=str(row.get("placement_group_id", "")),
        state=str(row.get("state", "")),
        scheduling_state=stats.get("scheduling_state"),
        bundle_nodes=[b.get("node_id") or None for b in bundles],
    )


def _problems(spec: PlacementSpec, replica: ReplicaPlacement, nodes: dict[str, NodeInfo]) -> list[str]:
    problems = []
    for index, node_id in enumerate(replica.bundle_nodes):
        node = nodes.get(node_id or "")
        if node is not None and not selector_matches(spec.label_selector, node.labels):
            problems.append(
                f"{replica.placement_group} bundle {index} is on node {node.node_id[:8]} {node.labels}"
            )
    if spec.nodes_per_replica > 1 and len(replica.nodes) != spec.nodes_per_replica:
        problems.append(
            f"{replica.placement_group} spans {len(replica.nodes)} nodes, not {spec.nodes_per_replica}: "
            "its nodes were fragmented, and cross-node tensor-parallel traffic will be slower"
        )
    return problems


def _node_info(raw: dict[str, Any]) -> NodeInfo:
    return NodeInfo(
        node_id=str(raw.get("node_id", "")),
        ip=str(raw.get("node_ip", "")),
        labels={str(k): str(v) for k, v in (raw.get("labels") or {}).items()},
        gpus=float((raw.get("resources_total") or {}).get("GPU", 0.0)),
        alive=raw.get("state") == "ALIVE",
    )


def _state_rows(payload: Any) -> list[dict[str, Any]]:
    """The rows of a state API answer: {"data": {"result": {"result": [...]}}}."""
    try:
        rows = payload["data"]["result"]["result"]
    except (KeyError, TypeError):
        return []
    return [row for row in rows if isinstance(row, dict)]


def _auth_headers() -> dict[str, str]:
    """Ray's dashboard token header (Ray 2.60 turns token auth on whenever ~/.ray/auth_token exists).

    Ray's own loader finds the token where Ray looks (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray); a
    dashboard without token auth ignores the header.
    """
    return dict(AuthenticationTokenLoader.instance().get_token_for_http_header())


async def _get_json(url: str, headers: dict[str, str], timeout_s: float, errors: list[str]) -> Any:
    try:
        return await asyncio.to_thread(_fetch_json, url, headers, timeout_s)
    except (OSError, ValueError) as e:  # URLError and timeouts are OSErrors; bad JSON is a ValueError
        errors.append(f"GET {url}: {e}")
        return None


def _fetch_json(url: str, headers: dict[str, str], timeout_s: float) -> Any:
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # bounds every socket wait
        return json.loads(response.read())
