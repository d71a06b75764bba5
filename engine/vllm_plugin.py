"""vLLM general plugin (entry point group `vllm.general_plugins`).

vLLM loads general plugins in every one of its processes (the AsyncLLM front end, the engine core
subprocess, workers), which is the only place to adjust NIXL and the CPU before the KV connector starts.
It does nothing unless the engine host set PDSERVE_VLLM_PLUGIN=1, so other vLLM users in the same
environment are not affected.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from engine import start_phases


def register() -> None:
    if os.environ.get("PDSERVE_VLLM_PLUGIN") != "1":
        return
    host_pid = os.environ.get("PDSERVE_ENGINE_HOST_PID")
    if host_pid is not None and int(host_pid) != os.getpid():
        _die_with_parent()
    # vLLM sets this itself unless NIXL was imported first; we import NIXL below, so set it here.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    if os.environ.get("PDSERVE_NIXL_PROG_THREAD", "0") != "1":
        _disable_nixl_progress_thread()
    if os.environ.get("PDSERVE_CPU_AMX_INIT") == "1":
        _request_amx_permission()
    if os.environ.get(start_phases.ENV):
        _time_start_phases()


def _die_with_parent() -> None:
    """vLLM's engine core and workers are child processes of the Serve replica (the engine core's own
    children, in turn). If Ray kills a replica hard (node drain, `ray stop --force`, OOM), nothing runs
    vLLM's shutdown; the kernel's parent-death signal makes sure no engine process outlives its parent."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _time_start_phases() -> None:
    """Time vLLM's start phases where they run (engine/start_phases.py): whichever of these classes this
    process uses, its method appends its duration to the host's file."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    for owner, method, phase in (
        (BaseModelLoader, "load_model", "weights"),
        (EngineCore, "_initialize_kv_caches", "engine_init"),
        (Worker, "compile_or_warm_up_model", "compile"),
        (CPUWorker, "compile_or_warm_up_model", "compile"),
        (NixlBaseConnectorWorker, "_nixl_handshake", "nixl_handshake"),
    ):
        _timed(owner, method, phase)


def _timed(owner: type, method: str, phase: str) -> None:
    real = owner.__dict__.get(method)
    if real is None or getattr(real, "_pdserve_timed", False):
        return

    @functools.wraps(real)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return real(*args, **kwargs)
        finally:
            start_phases.record(phase, time.monotonic() - started)

    timed._pdserve_timed = True  # type: ignore[attr-defined]
    setattr(owner, method, timed)


def _disable_nixl_progress_thread() -> None:
    """UCX's progress thread busy-spins one core per engine; on a small CPU machine that starves the
    engines themselves. Without it, vLLM's own polling of transfer status drives progress."""
    from vllm.distributed import nixl_utils

    real = nixl_utils._load_nixl_attr("nixl_agent_config")
    if real is None or getattr(real, "_pdserve_wrapped", False):
        return

    @functools.wraps(real)
    def config_without_progress_thread(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("enable_prog_thread", False)
        return real(*args, **kwargs)

    config_without_progress_thread._pdserve_wrapped = True  # type: ignore[attr-defined]
    # Modules that later do `from vllm.distributed.nixl_utils import nixl_agent_config` get this one.
    nixl_utils.nixl_agent_config = config_without_progress_thread


def _request_amx_permission() -> None:
    """bf16 on CPU: the AMX attention kernel dies with SIGILL when a process's first attention call
    follows a KV pull, because AMX permission was never requested from the kernel."""
    import torch

    init_amx = getattr(torch.cpu, "_init_amx", None)
    if init_amx is not None:
        init_amx()
