"""The engine host: one vLLM AsyncLLM inside a Serve replica, in the prefill or the decode role.

Prefill and decode replicas are the same code with a different KV role: a prefill engine is a NIXL KV
producer (computes the prompt, keeps its blocks until decode reads them), a decode engine a KV consumer
(pulls those blocks, then generates). This module is the only one that imports vLLM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from engine import start_phases
from engine.batched_outputs import stream_in_batches
from engine.gpu_stats import GpuReader
from engine.messages import (
    Constraint,
    EngineRequest,
    EngineStats,
    ReplicaFailed,
    ReplicaInfo,
    Sampling,
    StreamBatch,
)
from engine.model_source import resolve_model_dir
from engine.ports import free_ports
from engine.spec import EngineSpec
from engine.stats import EngineCounters, counters_logger_factory, unexported_prometheus_logger

log = logging.getLogger(__name__)


def _kv_event_endpoints(
    spec: EngineSpec, replica_id: str, node_ip: str, ports: tuple[int, int]
) -> tuple[tuple[str, str] | None, str | None, str | None]:
    """(what vLLM's publisher binds: (pub, replay)), and the addresses subscribers connect to.

    vLLM's publisher binds wildcard and ipc endpoints and *connects* to host-specific ones. A one-machine
    cluster uses ipc sockets (reachable from this machine only: KV events carry prompt token ids); a
    multi-node cluster must bind TCP on every interface so the router's node can subscribe."""
    if not spec.kv_events:
        return None, None, None
    if spec.bind_host in ("127.0.0.1", "localhost"):
        base = Path(tempfile.gettempdir()) / "pdserve-kv"
        base.mkdir(mode=0o700, exist_ok=True)
        pub, replay = f"ipc://{base}/{replica_id}.pub", f"ipc://{base}/{replica_id}.replay"
        return (pub, replay), pub, replay
    pub_port, replay_port = ports
    return (
        (f"tcp://*:{pub_port}", f"tcp://*:{replay_port}"),
        f"tcp://{node_ip}:{pub_port}",
        f"tcp://{node_ip}:{replay_port}",
    )


class EngineHost:
    """Owns one AsyncLLM: start-up, shutdown, health, stats, and the primitive every role's protocol runs on
    (`_outputs`: one request's vLLM outputs, failures raised as ReplicaFailed). Construct, then `start()`
    (blocking: loads the model and starts the engine core subprocess). The roles add their protocol:
    prefill/engine.py (the prefill leg), decode/engine.py (streaming, KV export, release)."""

    def __init__(self, spec: EngineSpec, *, replica_id: str, node_id: str, node_ip: str) -> None:
        self.spec = spec
        self.replica_id = replica_id
        self.node_id = node_id
        self.node_ip = node_ip
        self.nixl_port, pub_port, replay_port = free_ports(3)
        self.kv_events_bind, self.kv_events_endpoint, self.kv_events_replay_endpoint = _kv_event_endpoints(
            spec, replica_id, node_ip, (pub_port, replay_port)
        )
        self.counters = EngineCounters()
        # NVML is only opened where the engine runs on GPUs.
        self._gpus = GpuReader(enabled=spec.device == "cuda")
        self._llm: Any = None
        self._failure: str | None = None
        self._inflight = 0
        self._busy_since = time.monotonic()
        # Where vLLM's processes write their start phases (engine/start_phases.py), and what they were.
        fd, phases_file = tempfile.mkstemp(prefix="pdserve-start-", suffix=".jsonl")
        os.close(fd)
        self._phases_file = Path(phases_file)
        self.start_phases: dict[str, float] = {}

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._configure_process_env()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**self._engine_kwargs())
        started = time.monotonic()
        loggers: list[Any] = [counters_logger_factory(self.counters), unexported_prometheus_logger()]
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=loggers)
        self.start_phases = start_phases.engine_phases(
            start_phases.read(self._phases_file), time.monotonic() - started
        )
        # vLLM reads its environment variables on its per-token path (os.environ each time) unless told they
        # no longer change, as its engine core is: this process's were all set above, before the engine.
        from vllm import envs

        envs.enable_envs_cache()
        log.info(
            "%s engine %s ready in %.1f s (nixl side channel %s:%d, kv events %s)",
            self.spec.role,
            self.replica_id,
            time.monotonic() - started,
            self.node_ip,
            self.nixl_port,
            self.kv_events_endpoint,
        )

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        self._phases_file.unlink(missing_ok=True)

    def _configure_process_env(self) -> None:
        # Read by vLLM (and inherited by its engine-core subprocess) when the engine starts; this
        # process hosts exactly one engine, so process environment is the engine's configuration.
        env = {
            "PDSERVE_VLLM_PLUGIN": "1",
            # Lets the plugin tell this process from the engine processes it spawns (engine/vllm_plugin.py).
            "PDSERVE_ENGINE_HOST_PID": str(os.getpid()),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": self.node_ip,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.nixl_port),
            start_phases.ENV: str(self._phases_file),
        }
        if self.spec.bind_host in ("127.0.0.1", "localhost"):
            # A one-machine cluster: vLLM's own sockets and NIXL's UCX transports (which listen on every
            # network device) stay on loopback, not on the machine's address.
            env["VLLM_HOST_IP"] = "127.0.0.1"
            env["UCX_NET_DEVICES"] = "lo"
        if self.spec.device == "cpu":
            (bind,) = self.spec.cpu_threads_bind  # the replica chose its entry (engine/replica.py)
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.spec.cpu_kv_cache_gib)
            if self.spec.dtype == "bfloat16":
                env["PDSERVE_CPU_AMX_INIT"] = "1"
        os.environ.update(env)

    def _engine_kwargs(self) -> dict[str, Any]:
        spec = self.spec
        kwargs: dict[str, Any] = {
            "model": str(resolve_model_dir(spec.model_source)),
            "served_model_name": spec.served_name,
            "dtype": spec.dtype,
            "max_model_len": spec.max_model_len,
            "block_size": spec.block_size,
            "enable_prefix_caching": True,
            "disable_log_stats": False,
        }
        if spec.otlp_traces_endpoint is not None:
            kwargs["otlp_traces_endpoint"] = spec.otlp_traces_endpoint
        if spec.kv_transfer:
            kwargs["kv_transfer_config"] = {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_producer" if spec.role == "prefill" else "kv_consumer",
                "kv_buffer_device": spec.device,
                "kv_load_failure_policy": spec.kv_load_failure_policy,
                "engine_id": f"{spec.role}-{self.replica_id}",
            }
            if spec.kv_readback_ttl_s > 0:
                # Decode engines pin each finished request's blocks; prefill engines may pull from them.
                kwargs["kv_transfer_config"]["kv_connector_extra_config"] = {
                    "bidirectional_kv_xfer": True,
                    "decoder_kv_blocks_ttl": spec.kv_readback_ttl_s,
                }
        if self.kv_events_bind is not None:
            kwargs["kv_events_config"] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.kv_events_bind[0],
                "replay_endpoint": self.kv_events_bind[1],
                "topic": "kv",
            }
        kwargs.update(spec.engine_args)
        if isinstance(kwargs.get("structured_outputs_config"), dict):
            # vLLM's engine args convert most config dicts from YAML themselves, but not this one.
            from vllm.config import StructuredOutputsConfig

            kwargs["structured_outputs_config"] = StructuredOutputsConfig(
                **kwargs["structured_outputs_config"]
            )
        return kwargs

    # ---- serving -------------------------------------------------------------------------------

    async def _one_token(self, req: EngineRequest, kv: dict[str, Any]) -> Any:
        """Run a one-token request with connector params to its end; vLLM's final output. ignore_eos and no
        stop strings make it always finish by length, the case in which vLLM keeps its KV for a transfer.
        Its token is never read: no detokenizer (vLLM primes one with the whole prompt, ~1 ms at 128k)."""
        sampling = Sampling(max_tokens=1, temperature=0.0, ignore_eos=True)
        final = None
        async for out in self._outputs(req, self._sampling_params(sampling, kv, detokenize=False)):
            final = out
        if final is None:
            raise RuntimeError(f"{req.request_id} produced no output")
        return final

    async def _outputs(
        self, req: EngineRequest, params: Any, batch: StreamBatch | None = None
    ) -> AsyncGenerator[Any, None]:
        """vLLM's outputs for one request; an engine that died or hung raises ReplicaFailed, which the router
        answers by moving the request to another replica. Closing or cancelling it aborts the request in the
        engine (vLLM's generate does on its way out). With `batch`, each output is a streamed batch: the
        engine steps' outputs merged until the batch is due (engine/batched_outputs.py)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if (reason := self.failure()) is not None:
            raise ReplicaFailed(self.replica_id, reason)
        if self._inflight == 0:
            self._busy_since = time.monotonic()
        self._inflight += 1
        prompt = {"prompt_token_ids": req.prompt_token_ids}  # trace_headers: vLLM's spans join the trace
        outputs = (
            self._llm.generate(prompt, params, request_id=req.request_id, trace_headers=req.trace_context)
            if batch is None
            else stream_in_batches(self._llm, req, prompt, params, batch)
        )
        try:
            # No race against the watchdog per step: a hung engine's streams are failed by `failure`.
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    yield out
        except EngineDeadError:
            reason = self.failure() or "its vLLM engine core died"
            log.error("%s engine %s failed: %s", self.spec.role, self.replica_id, reason)
            raise ReplicaFailed(self.replica_id, reason) from None
        finally:
            self._inflight -= 1

    def failure(self) -> str | None:
        """Why this engine can no longer serve (None while it can): its engine core process died, or it
        has had requests in flight and reported no step for `spec.hang_timeout_s` (e.g. stopped by a
        signal). Sticky: a failed engine stays failed until Serve replaces the replica."""
        if self._failure is None and self._llm is not None:
            idle_s = time.monotonic() - max(self.counters.last_step_at, self._busy_since)
            if self._llm.errored:
                self._failure = "its vLLM engine core died"
            elif self._inflight and idle_s > self.spec.hang_timeout_s:
                self._failure = (
                    f"its engine reported no step for {idle_s:.0f} s with {self._inflight} requests in flight"
                )
        if self._failure is not None and self._inflight and self._llm is not None:
            # A hung engine's requests would wait on it forever: end their streams as vLLM ends a dead
            # engine's (every one still open, each time the watchdog asks: one may have just started).
            from vllm.v1.engine.exceptions import EngineDeadError

            self._llm.output_processor.propagate_error(EngineDeadError())
        return self._failure

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    def _sampling_params(
        self, s: Sampling, kv_transfer_params: dict[str, Any] | None, *, detokenize: bool = True
    ) -> Any:
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        return SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=0 if s.top_k == -1 else s.top_k,
            min_p=s.min_p,
            seed=s.seed,
            stop=list(s.stop) or None,
            stop_token_ids=list(s.stop_token_ids) or None,
            ignore_eos=s.ignore_eos,
            frequency_penalty=s.frequency_penalty,
            presence_penalty=s.presence_penalty,
            repetition_penalty=s.repetition_penalty,
            skip_special_tokens=s.skip_special_tokens,
            structured_outputs=structured_outputs(s.constraint),
            logprobs=s.logprobs,
            output_kind=RequestOutputKind.DELTA,
            detokenize=detokenize,
            extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
        )

    # ---- introspection -------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        c = self.counters
        return EngineStats(
            replica_id=self.replica_id,
            role=self.spec.role,
            node_id=self.node_id,
            running=c.running,
            waiting=c.waiting,
            kv_cache_usage=c.kv_cache_usage,
            prompt_tokens_computed=c.prompt_tokens_computed,
            prompt_tokens_local_cache_hit=c.prompt_tokens_local_cache_hit,
            prompt_tokens_external_kv=c.prompt_tokens_external_kv,
            nixl_bytes_transferred=c.nixl_bytes_transferred,
            nixl_transfers=c.nixl_transfers,
            nixl_transfer_seconds=c.nixl_transfer_seconds,
            requests_finished=c.requests_finished,
            spec_drafts=c.spec_drafts,
            spec_draft_tokens=c.spec_draft_tokens,
            spec_accepted_tokens=c.spec_accepted_tokens,
            step_s=c.step_s if c.running else 0.0,
            gpus=self._gpus.sample(),
        )

    def info(self, *, draining: bool = False) -> ReplicaInfo:
        return ReplicaInfo(
            replica_id=self.replica_id,
            role=self.spec.role,
            node_id=self.node_id,
            kv_events_endpoint=self.kv_events_endpoint,
            kv_events_replay_endpoint=self.kv_events_replay_endpoint,
            nixl_host=self.node_ip,
            nixl_port=self.nixl_port,
            block_size=self.spec.block_size,
            ready=self._llm is not None,
            draining=draining,
            failed=self.failure() or "",
            stats=self.stats(),
            start_phases=self._start_phases(),
        )

    def _start_phases(self) -> dict[str, float]:
        """The start's phases, and once it happened, the first NIXL handshake (a decode engine's, at its
        first KV transfer: the file is read again until then)."""
        if self.spec.kv_transfer and "nixl_handshake" not in self.start_phases and self._llm is not None:
            handshake = start_phases.read(self._phases_file).get("nixl_handshake")
            if handshake is not None:
                self.start_phases = {**self.start_phases, "nixl_handshake": handshake}
        return self.start_phases

    async def check_health(self) -> None:
        if self._llm is None:
            raise RuntimeError("engine not started")
        if (reason := self.failure()) is not None:
            raise RuntimeError(reason)
        await self._llm.check_health()


def structured_outputs(c: Constraint | None) -> Any:
    """vLLM's structured-output parameters for a constraint (None: unconstrained)."""
    if c is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if c.json_schema is not None:
        return StructuredOutputsParams(json=c.json_schema)
    if c.json_object:
        return StructuredOutputsParams(json_object=True)
    if c.regex is not None:
        return StructuredOutputsParams(regex=c.regex)
    return StructuredOutputsParams(choice=list(c.choice or ()))
