"""`pdserve apply -f FILE`: change a running cluster to match a topology file, declaratively.

1. Load and validate the new topology; read the running one back from Serve (the registry deployment's
   `user_config`, see cluster/serve_config.py) through the dashboard's Serve REST API.
2. Show the difference by field path (`pools.decode.replicas: 1 -> 3`) and what Serve will do with each
   deployment (scale, roll one replica at a time, update in place).
3. Refuse changes only a restart of pdserve can make: the fields the topology marks `RESTART` (the model,
   the endpoint, Ray), and a prefill pool appearing or disappearing. The router follows its `router`
   section in place (router/process.py), Serve reconciles the pools.
4. Deploy the compiled Serve config (the same path as `pdserve up`) and wait, within
   `ray.placement_timeout_s`, until the application runs the new config; then until replicas being removed
   have drained. Placement problems are reported with cluster/placement.py's reasons; nothing hangs.

Serve's controller does the work: it drains replicas it scales away (graceful_shutdown_*), and rolls a
pool whose EngineSpec changed by starting a replacement before stopping an old replica (max surge).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import msgspec

from cluster.placement import placement_specs, wait_for_placement
from cluster.serve_config import REGISTRY, compile_serve_config, running_topology, serves_router
from cluster.topology import Topology

_ROLLOUT_KEYS = {"max_surge_percent", "rolling_update_percentage"}
UNSET = "<unset>"  # a key present on one side of a diff only (e.g. a node label added)
_ACTIVE_STATES = ("STARTING", "PENDING_MIGRATION", "UPDATING", "RECOVERING", "RUNNING")


class ApplyError(RuntimeError):
    """The change cannot be applied (refused, or the cluster did not reach it in time), and why."""


class FieldChange(msgspec.Struct, frozen=True):
    path: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.path}: {_show(self.old)} -> {_show(self.new)}"


class DeploymentAction(msgspec.Struct, frozen=True):
    deployment: str
    action: str  # "scale" | "roll" | "update in place" | "add" | "remove" | "unchanged"
    detail: str

    def __str__(self) -> str:
        return f"{self.deployment}: {self.detail}"


class ApplyResult(msgspec.Struct, frozen=True, kw_only=True):
    changes: list[FieldChange]
    actions: list[DeploymentAction]
    applied: bool  # False for a dry run or when there was nothing to change
    running_s: float = 0.0  # deploy -> the application runs the new config
    drained_s: float = 0.0  # deploy -> the replicas it removed have stopped
    drained_replicas: int = 0


def diff_topologies(old: Topology, new: Topology) -> list[FieldChange]:
    """Every leaf field that differs, by dotted path (mappings are walked, lists compared whole)."""
    before, after = _flatten(msgspec.to_builtins(old)), _flatten(msgspec.to_builtins(new))
    changes = []
    for path in sorted(before.keys() | after.keys()):
        a, b = before.get(path, UNSET), after.get(path, UNSET)
        if a != b:
            changes.append(FieldChange(path, a, b))
    return changes


def restart_reasons(old: Topology, changes: list[FieldChange]) -> list[str]:
    """The changes `apply` refuses, each with why (empty: everything can be applied live)."""
    reasons = []
    for change in changes:
        how = apply_mode(change.path)
        if how == "restart":
            reasons.append(f"{change}: read once by the running pdserve (model, endpoint, Ray)")
        elif change.path == "pools.prefill.replicas" and (change.old == 0) != (change.new == 0):
            reasons.append(
                f"{change}: turning disaggregation on or off changes the application's deployments and the "
                "router's request path"
            )
    return reasons


def apply_mode(path: str) -> str:
    """How a change of the field at `path` is applied: "restart", "apply-only" or "live", from the marks the
    topology's types carry (cluster.topology.RESTART / APPLY_ONLY)."""
    mode = "live"
    info: Any = msgspec.inspect.type_info(Topology)
    for name in path.split("."):
        fields = getattr(_unwrap_struct(info), "fields", None)
        field = next((f for f in fields or () if f.encode_name == name), None)
        if field is None:
            break  # a mapping's key (labels, engine.extra): its field's mark holds
        info = field.type
        mode = (info.extra or {}).get("apply", mode) if isinstance(info, msgspec.inspect.Metadata) else mode
    return mode


def _unwrap_struct(info: Any) -> Any:
    """The struct type inside Metadata / Optional wrappers (None when there is none)."""
    while True:
        if isinstance(info, msgspec.inspect.Metadata):
            info = info.type
        elif isinstance(info, msgspec.inspect.UnionType):
            info = next(
                (
                    t
                    for t in info.types
                    if isinstance(t, msgspec.inspect.StructType | msgspec.inspect.Metadata)
                ),
                None,
            )
        else:
            return info if isinstance(info, msgspec.inspect.StructType) else None


def plan_actions(old: Topology, new: Topology, *, serve_router: bool = False) -> list[DeploymentAction]:
    """What Serve will do with each deployment, read from the two compiled Serve configs (`serve_router`: of
    an application that runs its own routers)."""
    before, after = _deployments(old, serve_router), _deployments(new, serve_router)
    actions = []
    for name in [*after, *(n for n in before if n not in after)]:
        a, b = before.get(name), after.get(name)
        if a is None or b is None:
            kind = "add" if a is None else "remove"
            actions.append(DeploymentAction(name, kind, f"{kind} the deployment"))
            continue
        if name == REGISTRY:
            same = a == b
            detail = "unchanged" if same else "records the new topology (reconfigured in place)"
            actions.append(DeploymentAction(name, "unchanged" if same else "update in place", detail))
            continue
        heavy = [k for k in ("ray_actor_options", *_placement_keys(a, b)) if a.get(k) != b.get(k)]
        size_a, size_b = _size(a), _size(b)
        scale = size_a != size_b
        # Serve's rollout percentages are derived from the replica count: a scale changes them too.
        derived = _ROLLOUT_KEYS if scale else set()
        light = sorted(
            k
            for k in a.keys() | b.keys()
            if k not in heavy and k not in _SIZE_KEYS and k not in derived and a.get(k) != b.get(k)
        )
        parts = []
        if scale and isinstance(size_a, int) and isinstance(size_b, int):
            verb = "start" if size_b > size_a else "drain and stop"
            parts.append(f"scale {size_a} -> {size_b} replicas ({verb} {abs(size_b - size_a)})")
        elif scale:
            parts.append(f"scale: {size_a} -> {size_b}")
        if heavy:
            surge = b.get("max_surge_percent", 0) > 0
            how = "a replacement starts before each old replica drains" if surge else "each drains first"
            parts.append(f"roll {size_b} replicas one at a time ({how}; changed: {', '.join(heavy)})")
        if light:
            parts.append(f"update in place: {', '.join(light)}")
        kind = "roll" if heavy else "scale" if scale else "update in place" if light else "unchanged"
        actions.append(DeploymentAction(name, kind, "; ".join(parts) or "unchanged"))
    return actions


async def apply_topology(
    new: Topology,
    *,
    dashboard_url: str,
    app_name: str = "pdserve",
    dry_run: bool = False,
    out: Callable[[str], None] = print,
    poll_s: float = 0.5,
) -> ApplyResult:
    """Show the diff and plan; unless `dry_run`, deploy and wait until it runs (ApplyError otherwise)."""
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    client = ServeSubmissionClient(dashboard_url)
    details = await asyncio.to_thread(client.get_serve_details)
    app = (details.get("applications") or {}).get(app_name)
    if app is None or not app.get("deployed_app_config"):
        raise ApplyError(f"no application {app_name!r} is deployed on the cluster at {dashboard_url}")
    old = running_topology(app["deployed_app_config"])
    changes = diff_topologies(old, new)
    if not changes:
        out("no changes: the running application already matches")
        return ApplyResult(changes=[], actions=[], applied=False)
    out("changes:")
    for change in changes:
        out(f"  {change}")
    refused = restart_reasons(old, changes)
    if refused:
        raise ApplyError(
            "these changes need a restart of pdserve (`pdserve down` then `pdserve up`):\n  "
            + "\n  ".join(refused)
        )
    # The same application shape as deployed: one that runs its own router keeps it.
    own_router = serves_router(app["deployed_app_config"])
    actions = plan_actions(old, new, serve_router=own_router)
    out("plan:")
    for action in actions:
        out(f"  {action}")
    if dry_run:
        out("dry run: nothing deployed")
        return ApplyResult(changes=changes, actions=actions, applied=False)

    before = set(_replica_states(details, app_name))
    config = compile_serve_config(new, app_name=app_name, serve_router=own_router)
    started = time.monotonic()
    await asyncio.to_thread(client.deploy_applications, config)
    rolled = {a.deployment for a in actions if a.action == "roll"}
    timeout_s = new.ray.placement_timeout_s
    running_s = await _wait_running(client, app_name, new, rolled, started, timeout_s, dashboard_url, poll_s)
    out(f"application {app_name} runs the new config after {running_s:.1f} s")
    now = _replica_states(await asyncio.to_thread(client.get_serve_details), app_name)
    replaced = {rid for rid in before if now.get(rid) != "RUNNING"}
    drain_timeout = max(pool.graceful_shutdown_timeout_s for _, pool in new.pools.items()) + 30.0
    drained_s = await _wait_drained(client, app_name, replaced, started, drain_timeout, poll_s)
    if replaced:
        out(f"{len(replaced)} replica(s) drained and stopped after {drained_s:.1f} s")
    return ApplyResult(
        changes=changes,
        actions=actions,
        applied=True,
        running_s=running_s,
        drained_s=drained_s,
        drained_replicas=len(replaced),
    )


async def _wait_running(
    client: Any,
    app_name: str,
    topo: Topology,
    rolled: set[str],
    started: float,
    timeout_s: float,
    dashboard_url: str,
    poll_s: float,
) -> float:
    """Until every pool has its new number of RUNNING replicas (rolled pools: all started after the
    deploy) and Serve says the application is RUNNING; ApplyError with the reasons after `timeout_s`."""
    # An autoscaled pool: whatever count Serve's policy targets now (None).
    wanted = {
        role: None if pool.autoscaling is not None else pool.replicas
        for role, pool in topo.pools.items()
        if pool.replicas > 0
    }
    deadline = started + timeout_s
    unmet = "no status yet"
    while time.monotonic() < deadline:
        details = await asyncio.to_thread(client.get_serve_details)
        app = (details.get("applications") or {}).get(app_name) or {}
        unmet = _unmet(app, wanted, rolled)
        if not unmet:
            return time.monotonic() - started
        if app.get("status") == "DEPLOY_FAILED":
            raise ApplyError(f"application {app_name} failed to deploy: {app.get('message')}")
        await asyncio.sleep(poll_s)
    report = await wait_for_placement(app_name, placement_specs(topo), 0.0, dashboard_url)
    raise ApplyError(
        f"application {app_name} does not run the new config after {timeout_s:.0f} s: {unmet}\n"
        f"{report.summary()}"
    )


def _unmet(app: dict[str, Any], wanted: dict[str, int | None], rolled: set[str]) -> str:
    if app.get("status") != "RUNNING":
        return f"application status {app.get('status')}: {app.get('message') or 'deploying'}"
    deployed_at = float(app.get("last_deployed_time_s") or 0.0)
    deployments = app.get("deployments") or {}
    for name, count in wanted.items():
        dep = deployments.get(name) or {}
        replicas = dep.get("replicas") or []
        running = [r for r in replicas if r.get("state") == "RUNNING"]
        count = dep.get("target_num_replicas") if count is None else count
        if dep.get("target_num_replicas") != count or len(running) != count:
            return f"deployment {name}: {len(running)}/{count} replicas RUNNING ({dep.get('status')})"
        if name in rolled and any(float(r.get("start_time_s") or 0.0) < deployed_at for r in running):
            return f"deployment {name}: still rolling"
        if any(r.get("state") in _ACTIVE_STATES and r.get("state") != "RUNNING" for r in replicas):
            return f"deployment {name}: replicas still starting"
    return ""


async def _wait_drained(
    client: Any, app_name: str, replaced: set[str], started: float, timeout_s: float, poll_s: float
) -> float:
    """Wait until the replicas the update removed (scaled away or rolled) are gone: Serve stops each only
    after its in-flight requests finished (or its graceful_shutdown_timeout_s passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = replaced & set(_replica_states(await asyncio.to_thread(client.get_serve_details), app_name))
        if not left or time.monotonic() >= deadline:
            return time.monotonic() - started
        await asyncio.sleep(poll_s)


def _replica_states(details: dict[str, Any], app_name: str) -> dict[str, str]:
    """replica id -> Serve state, for every engine replica Serve still has (STOPPING ones included)."""
    app = (details.get("applications") or {}).get(app_name) or {}
    return {
        str(r.get("replica_id")): str(r.get("state"))
        for name, dep in (app.get("deployments") or {}).items()
        if name != REGISTRY
        for r in dep.get("replicas") or []
    }


_SIZE_KEYS = ("num_replicas", "autoscaling_config")


def _size(deployment: dict[str, Any]) -> int | str:
    """A deployment's replica count, or its autoscaled range and targets."""
    auto = deployment.get("autoscaling_config")
    if auto is None:
        return int(deployment["num_replicas"])
    targets = auto["policy"]["policy_kwargs"]
    own = ("queue_s",) if targets["role"] == "prefill" else ("kv_usage", "running_seqs", "tpot_s")
    shown = "".join(f", {k} {targets[k]:g}" for k in own if targets[k] is not None)
    bounds = f"{auto['min_replicas']}..{auto['max_replicas']}"
    return (
        f"autoscaled {bounds} replicas (warm {targets['warm_replicas']}, window"
        f" {auto['look_back_period_s']:g} s, scale-down delay {targets['hold_s']:g} s{shown})"
    )


def _deployments(topo: Topology, serve_router: bool) -> dict[str, dict[str, Any]]:
    (app,) = compile_serve_config(topo, serve_router=serve_router)["applications"]
    return {d["name"]: d for d in app["deployments"]}


def _placement_keys(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k.startswith("placement_group"))


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: value}


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
