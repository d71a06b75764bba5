"""The packages are layers that import one way, with no import circle between modules, and modules stay
small enough to read top to bottom.

    bench    measures everything below (may import any package)
    cluster  the CLI, topology, Serve application: composes what is below
    router   the request path in front of the engines
    prefill, decode   the two engine roles: their protocol on top of the engine host (engine/host.py)
    engine   one vLLM engine on a replica, and the messages every process shares
    pdserve_client    the public gRPC API's stubs and the SDK agent backends import: nothing of pdserve

Inside router/, the stages import one way too, in request-path order (ROUTER_STAGES; router/README.md).

A lower layer never imports a higher one (lazy imports inside functions count too): the production CLI does
not depend on the benchmarks (they add `pdserve replay` through an entry point), the router runs without the
cluster's topology, an engine replica without the cluster's registry.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pdserve_client", "engine", "prefill", "decode", "router", "cluster", "bench")
# What each package may import, besides itself.
ALLOWED = {
    "pdserve_client": set(),
    "engine": set(),
    "prefill": {"engine"},
    "decode": {"engine"},
    "router": {"engine", "pdserve_client"},
    "cluster": {"pdserve_client", "engine", "prefill", "decode", "router"},
    "bench": {"pdserve_client", "engine", "prefill", "decode", "router", "cluster"},
}
# router/'s stages, lowest first: each imports only from stages before it (and itself). A stage is a folder
# or a module of router/.
ROUTER_STAGES = (
    # what every stage shares: settings, messages, errors, per-session state, block hashes, service times,
    # metrics
    ("config", "messages", "errors", "service_time", "sessions", "block_hash", "metrics"),
    ("intake",),  # validation, tokenization, chat and token-id sessions, output parsing
    ("policy",),  # the routing cost and choice, shared with the replay
    ("view",),  # the cluster picture: registry, KV events and index, load
    ("decision",),  # admission, hashing, readback: a Route per request
    ("request",),  # one lifecycle object per request
    ("legs",),  # the calls to prefill and decode, failover
    ("generate",),  # the request path in order
    ("doors",),  # gRPC and OpenAI HTTP
    ("process",),  # builds and serves it all
)
GENERATED = {"pdserve_client/api/pdserve_pb2.py", "pdserve_client/api/pdserve_pb2_grpc.py"}
MAX_LINES = 400
# Modules above MAX_LINES, each with why it is one module.
LONG_MODULES = {
    "cluster/topology_checks.py": "every check a topology passes before start-up, one function per concern",
    "bench/replay/sim.py": "the replay's event loop: one simulator whose handlers share its state",
    "pdserve_client/sdk.py": "the gRPC client library: every call and its request/response mapping",
    "engine/tiny_model.py": "the built-in model, built offline: config, weights and tokenizer in one place",
    "cluster/cli.py": "the `pdserve` commands: one parser, one function per command",
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            name = rel[: -len(".py")].replace("/", ".").removesuffix(".__init__")
            out[name] = path
    return out


def _imports(path: Path) -> set[str]:
    """Every module `path` imports (absolute names within the project's packages), at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] in PACKAGES}


MODULES = _modules()
GRAPH = {name: {m for m in _imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_imports_a_layer_above_it(package: str) -> None:
    wrong = sorted(
        f"{name} imports {dep}"
        for name, deps in GRAPH.items()
        if name.split(".")[0] == package
        for dep in deps
        if dep.split(".")[0] not in ALLOWED[package] | {package}
    )
    assert not wrong, "\n".join(wrong)


def _stage(module: str) -> int:
    part = module.split(".")[1]
    return next(i for i, names in enumerate(ROUTER_STAGES) if part in names)


def test_router_stages_import_in_request_path_order() -> None:
    inside = {n for n in MODULES if n.startswith("router.") and not n.startswith("router.api")}
    unplaced = sorted(n for n in inside if not any(n.split(".")[1] in s for s in ROUTER_STAGES))
    assert not unplaced, f"modules of router/ in no stage of ROUTER_STAGES: {unplaced}"
    wrong = sorted(
        f"{name} imports {dep}"
        for name in inside
        for dep in GRAPH[name]
        if dep in inside and _stage(dep) > _stage(name)
    )
    assert not wrong, "\n".join(wrong)


def test_no_import_circle_between_modules() -> None:
    # A package's __init__ is not an edge: importing `a.b` runs `a/__init__`, which imports nothing here.
    graph = {n: {d for d in deps if MODULES[d].name != "__init__.py"} for n, deps in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for d in sorted(graph[n]):
            if state.get(d) == 1:
                return [*path[path.index(d) :], d]
            if d not in state and (circle := visit(d)):
                return circle
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (circle := visit(n)):
            pytest.fail("import circle: " + " -> ".join(circle))


def test_modules_stay_readable_or_say_why_not() -> None:
    long = {}
    for path in MODULES.values():
        rel = path.relative_to(REPO).as_posix()
        lines = len(path.read_text().splitlines())
        if rel not in GENERATED and lines > MAX_LINES:
            long[rel] = lines
    unexplained = sorted(f"{rel} ({n} lines)" for rel, n in long.items() if rel not in LONG_MODULES)
    assert not unexplained, f"over {MAX_LINES} lines without a stated reason: {unexplained}"
    stale = sorted(rel for rel in LONG_MODULES if rel not in long)
    assert not stale, f"no longer long, remove from LONG_MODULES: {stale}"
