"""The systems a side-by-side benchmark starts on this machine, one at a time, on the same model:

- `pd`: pdserve with its prefill and decode pools (deploy/local.yaml, every request through
  prefill -> NIXL -> decode);
- `pd-auto`: the same pools with the router choosing per request (deploy/local.yaml as written: a turn whose
  context the decode replica holds skips the prefill hop);
- `aggregated`: pdserve with no prefill pool (the decode engine prefills; no KV connector);
- `doubles`: pdserve on engine test doubles (engine/double.py; 1 prefill + 2 decode replicas): the serving
  layer's own limits, with no engine compute;
- `aggregated2`: pdserve with two decode engines (one a core) and no prefill pool: where a session's turns
  go decides what they find cached;
- `pd-ngram`: `pd` with ngram speculative decoding on the decode engine (4 tokens a draft), against `pd`;
- `pd-fp8`: `pd` with an fp8 KV cache in both pools (a byte a KV element: NIXL moves a quarter of float32's);
- `vllm`: a plain `vllm serve` (vLLM's OpenAI server) of the same model, with the engine arguments and the
  core binding pdserve's aggregated decode engine gets: the baseline without pdserve's router and Serve;
- `vllm-batched`: `vllm` streaming `router.stream_batch_tokens` tokens a message (`--stream-interval`), as
  pdserve streams at most that many: what pdserve's batching alone would give vLLM's server.

A pdserve system named `NAME:POLICY` (e.g. `aggregated2:round_robin`) is routed by that `router.policy`, a
cache-blind baseline (router/policy/cache_blind.py): pdserve's routing against a cache-blind one on the same
engines.

A pdserve system named `NAME@REV` (e.g. `aggregated@0b48427`) runs this repository as of git revision REV
(extracted with `git archive`, its packages first on PYTHONPATH, so the router, engines and CLI are all that
revision's): before against after in one run, on the same machine and workload.

A pdserve system named with `+http` last (e.g. `aggregated+http`, `aggregated@0b48427+http`) is sent the
workload on its OpenAI door (`server.http_port`) instead of its gRPC endpoint: the protocol `vllm serve`
speaks, with the same client.

Each is a context manager that yields the address to benchmark once the system serves, and stops it after.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import typing
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from bench.revision import extract
from cluster.cli import READY_LINE
from engine.ports import free_ports
from router.config import RouterPolicy

REPO = Path(__file__).resolve().parents[2]
PDSERVE = str(Path(sys.executable).with_name("pdserve"))
VLLM_SYSTEMS = ("vllm", "vllm-batched")
SYSTEMS = ("pd", "pd-auto", "aggregated", "aggregated2", "pd-ngram", "pd-fp8", "doubles", *VLLM_SYSTEMS)
DEFAULT_SYSTEMS = ("pd", "aggregated", "vllm")  # `--side-by-side` alone
POLICIES = typing.get_args(RouterPolicy)  # a pdserve system's `:POLICY`
READY_TIMEOUT_S = 600.0


class LocalCluster:
    """`pdserve up -f topology` in a subprocess, ready once it prints its ready line; `down()` stops it.
    `env`, `cwd`: the environment and folder of both commands (default: this process's)."""

    def __init__(self, topology: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.ready_s = 0.0
        self.env, self.cwd = env, cwd
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [PDSERVE, "up", "-f", str(topology)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=cwd,
        )
        ready = threading.Event()
        self.log: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.append(line)
                if line.startswith(READY_LINE):
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        while not ready.wait(1.0):
            if self.proc.poll() is not None:
                raise RuntimeError("pdserve up failed:\n" + "".join(self.log[-40:]))
        self.ready_s = time.monotonic() - started

    def down(self) -> None:
        subprocess.run([PDSERVE, "down"], capture_output=True, timeout=300, env=self.env, cwd=self.cwd)
        self.proc.wait(timeout=120)


# Each pdserve system: deploy/local.yaml with these overrides, by dotted path.
PDSERVE_SYSTEMS: dict[str, dict[str, Any]] = {
    "pd": {"router.mode": "disaggregate"},  # no local-prefill shortcut: this measures the P/D path
    "pd-auto": {},
    "aggregated": {"pools.prefill.replicas": 0},
    "aggregated2": {
        "pools.prefill.replicas": 0,
        "pools.decode.replicas": 2,
        "pools.decode.cpu.threads_bind": ["0", "1"],
    },
    "pd-ngram": {
        "router.mode": "disaggregate",
        "pools.decode.speculative": {"method": "ngram", "num_speculative_tokens": 4},
    },
    "pd-fp8": {"router.mode": "disaggregate", "model.kv_cache_dtype": "fp8"},
    # The engine test double (20 ms a token, no vLLM): what the serving layer alone sustains, with engines
    # that never slow down. 1 prefill + 2 decode replicas.
    "doubles": {
        "model.engine": "double",
        "pools.decode.replicas": 2,
        "pools.decode.max_ongoing_requests": 256,
        "pools.prefill.max_ongoing_requests": 512,
        "router.overload_queue_tokens": 1_000_000,
    },
}


def topology(base: Path, overrides: dict[str, Any], http: bool = False) -> dict[str, Any]:
    """`base` on free ports (distinct: the topology refuses a port used twice), with `overrides` by dotted
    path (e.g. `pools.decode.replicas`); `http`: its OpenAI door on as well."""
    topo = yaml.safe_load(base.read_text())
    grpc, metrics, dashboard, http_port = free_ports(4)
    for dotted, value in {
        "server.grpc_port": grpc,
        "server.metrics_port": metrics,
        "ray.dashboard_port": dashboard,
        **({"server.http_port": http_port} if http else {}),
        **overrides,
    }.items():
        node = topo
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return topo


@contextmanager
def pdserve(
    base: Path,
    overrides: dict[str, Any],
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    http: bool = False,
) -> Iterator[str]:
    """A pdserve cluster serving; yields its gRPC address, or with `http` its OpenAI door's URL."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "topology.yaml"
        topo = topology(base, overrides, http)
        path.write_text(yaml.safe_dump(topo))
        cluster = LocalCluster(path, env, cwd)
        try:
            server = topo["server"]
            yield f"http://127.0.0.1:{server['http_port']}" if http else f"127.0.0.1:{server['grpc_port']}"
        finally:
            cluster.down()


def vllm_serve_config(base: Path, port: int, batched: bool = False) -> tuple[dict[str, Any], dict[str, str]]:
    """vLLM server arguments (its `--config` file) and environment for the aggregated decode engine's
    settings: the same model, dtype, context, block size, prefix caching, engine arguments and cores;
    `batched`: streaming as many tokens a message as pdserve's router at most does."""
    from cluster.serve_app import engine_spec
    from cluster.topology_file import parse_topology
    from engine.model_source import resolve_model_dir

    topo = parse_topology(topology(base, PDSERVE_SYSTEMS["aggregated"]), str(base))
    spec = engine_spec(topo, "decode")
    config = {
        "model": str(resolve_model_dir(spec.model_source)),
        "served-model-name": spec.served_name,
        "dtype": spec.dtype,
        "max-model-len": spec.max_model_len,
        "block-size": spec.block_size,
        "enable-prefix-caching": True,
        "enable-prompt-tokens-details": True,  # usage then reports cached prompt tokens, as pdserve's does
        "host": "127.0.0.1",
        "port": port,
        **{k.replace("_", "-"): v for k, v in spec.engine_args.items()},
    }
    if batched:
        config["stream-interval"] = topo.router.stream_batch_tokens
    env = {}
    if spec.device == "cpu":
        env = {
            "VLLM_CPU_OMP_THREADS_BIND": spec.cpu_threads_bind[0],
            "VLLM_CPU_KVCACHE_SPACE": str(spec.cpu_kv_cache_gib),
        }
    return config, env


@contextmanager
def vllm_serve(base: Path, batched: bool = False) -> Iterator[str]:
    (port,) = free_ports(1)
    config, env = vllm_serve_config(base, port, batched)
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vllm.yaml"
        path.write_text(yaml.safe_dump(config))
        log = open(Path(tmp) / "vllm.log", "w+")  # noqa: SIM115 (read back on failure)
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--config", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )
        try:
            _wait_http(url, proc, log)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Any) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    last: OSError | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"vllm serve exited ({proc.returncode}):\n{log.read()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError as exc:  # not listening yet
            last = exc
        time.sleep(1.0)
    raise TimeoutError(f"vllm serve at {url} not serving after {READY_TIMEOUT_S:.0f} s ({last})")


HTTP_DOOR = "+http"  # last in a pdserve system's name: the workload goes to its OpenAI door


def _parts(system: str) -> tuple[str, str | None, str | None]:
    """`NAME[:POLICY][@REV][+http]` as (name, policy, revision)."""
    named, at, rev = system.removesuffix(HTTP_DOOR).partition("@")
    name, colon, policy = named.partition(":")
    return name, policy if colon else None, rev if at else None


def known(system: str) -> bool:
    """One of SYSTEMS, or a pdserve system routed by a baseline policy (`aggregated2:round_robin`), at a
    revision (`aggregated@REV`), through its OpenAI door (`aggregated+http`), or any of these together."""
    name, policy, rev = _parts(system)
    if policy is None and rev is None and not system.endswith(HTTP_DOOR):
        return name in SYSTEMS
    return name in PDSERVE_SYSTEMS and policy != "" and rev != "" and policy in (None, *POLICIES)


def overrides(system: str) -> dict[str, Any]:
    """A pdserve system's changes to the base topology, by dotted path (its `:POLICY` included)."""
    name, policy, _ = _parts(system)
    return PDSERVE_SYSTEMS[name] | ({} if policy is None else {"router.policy": policy})


@contextmanager
def revision(rev: str) -> Iterator[tuple[dict[str, str], Path]]:
    """The environment and folder that run pdserve as of git revision `rev`: its tree extracted beside, first
    on PYTHONPATH (the installed packages, shared, stay behind it) and the commands' working directory (Ray's
    workers put the driver's folder first on their path)."""
    with tempfile.TemporaryDirectory(prefix=f"pdserve-{rev}-") as tmp:
        extract(rev, Path(tmp))
        path = os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))
        yield {**os.environ, "PYTHONPATH": path}, Path(tmp)


@contextmanager
def started(system: str, base: Path) -> Iterator[str]:
    """System `system` (see `known`) serving; yields the address to benchmark."""
    name, _, rev = _parts(system)
    http = system.endswith(HTTP_DOOR)
    if name in VLLM_SYSTEMS:
        with vllm_serve(base, batched=name == "vllm-batched") as url:
            yield url
    elif rev:
        with revision(rev) as (env, tree), pdserve(base, overrides(system), env, tree, http) as target:
            yield target
    else:
        with pdserve(base, overrides(system), http=http) as target:
            yield target
