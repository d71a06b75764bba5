"""The engine host: one vLLM AsyncLLM inside a Serve replica, in the prefill or the decode role.

Prefill and decode replicas are the same code with a different KV role: a prefill engine is a NIXL KV
producer (computes the prompt, keeps its blocks until decode reads them), a decode engine a KV consumer
(pulls those blocks, then generates). This module is the only one that imports vLLM.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

from engine.messages import (
    PIN_ONLY_KV_PARAMS,
    Constraint,
    EngineRequest,
    EngineStats,
    PrefillResult,
    ReplicaFailed,
    ReplicaInfo,
    Sampling,
    TokenBatch,
    TokenLogprob,
)
from engine.model_source import resolve_model_dir
from engine.spec import EngineSpec
from engine.stats import EngineCounters, counters_logger_factory

log = logging.getLogger(__name__)

# The prefill leg asks vLLM to keep the prompt's KV for a remote decode (vLLM's NixlConnector protocol).
# Prefill request ids remembered by `release` (see `_hand`): far more than can be in flight at once.
_HANDED_KEPT = 65536
# When an idle decode engine steps after a `release` (see there): the NIXL handshake takes ~0.1 s on loopback.
_KICK_DELAYS_S = (0.25, 1.0, 3.0)

_PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports free on every interface now. All are held until the last is drawn: the kernel
    may hand a released port out again, and two equal ports would stop the engine (vLLM's publisher binds
    both of its endpoints, NIXL its side channel). Another process can still take one before vLLM binds it
    (a small race: Serve restarts the replica)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("0.0.0.0", 0))  # not listening: free on 0.0.0.0 means free on the node's own address
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


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
    """Owns one AsyncLLM. Construct, then `start()` (blocking: loads the model and starts the engine
    core subprocess), then serve `prefill` / `generate` / `stats` / `info`."""

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
        self._llm: Any = None
        self._failure: str | None = None
        self._failed = asyncio.Event()
        self._inflight = 0
        self._busy_since = time.monotonic()
        # Prefill requests whose KV this engine was handed (pulled, or released by vLLM's abort path):
        # `release` must not tell their prefill engine a second time. Bounded: only recent ids can race.
        self._handed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._kicks: set[asyncio.Task[None]] = set()

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._configure_process_env()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**self._engine_kwargs())
        started = time.monotonic()
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[counters_logger_factory(self.counters)])
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

    def _configure_process_env(self) -> None:
        # Read by vLLM (and inherited by its engine-core subprocess) when the engine starts; this
        # process hosts exactly one engine, so process environment is the engine's configuration.
        env = {
            "PDSERVE_VLLM_PLUGIN": "1",
            # Lets the plugin tell this process from the engine processes it spawns (engine/vllm_plugin.py).
            "PDSERVE_ENGINE_HOST_PID": str(os.getpid()),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": self.node_ip,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.nixl_port),
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

    async def prefill(self, req: EngineRequest) -> PrefillResult:
        """The prefill leg: compute the prompt, keep its KV for a remote decode, return where it is. Its one
        sampled token is discarded: decode samples the first token itself."""
        kv = dict(_PREFILL_KV_PARAMS)
        if req.kv_transfer_params:
            # KV readback: pull the prefix a decode engine keeps pinned, compute the rest.
            kv.update(req.kv_transfer_params)
            kv["do_remote_decode"], kv["do_remote_prefill"] = True, False
        started = time.monotonic()
        final = await self._one_token(req, kv)
        return PrefillResult(
            request_id=req.request_id,
            replica_id=self.replica_id,
            node_id=self.node_id,
            kv_transfer_params=final.kv_transfer_params,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_cached_tokens=int(final.num_cached_tokens or 0),
            prefill_ms=(time.monotonic() - started) * 1e3,
        )

    async def generate(self, req: EngineRequest) -> AsyncIterator[TokenBatch]:
        """Generate and stream tokens in batches: the first token at once (TTFT), then by count or
        time, whichever comes first. Cancelling the iterator aborts the request in the engine."""
        kv = req.kv_transfer_params
        if kv and kv.get("do_remote_prefill") and not self._hand(str(kv.get("remote_request_id", ""))):
            # Released already (the router gave this request up, then it arrived anyway): the prefill
            # engine may have reused those blocks, so compute the prompt here instead of pulling them.
            log.warning("%s: its prefill KV was released; computing the prompt locally", req.request_id)
            kv = None
        params = self._sampling_params(req.sampling, kv)
        max_batch, max_wait = (1, 0.0) if req.stream is None else (req.stream.tokens, req.stream.ms / 1e3)
        ids: list[int] = []
        text: list[str] = []
        first_sent = False
        batch_started = time.monotonic()
        want_logprobs = req.sampling.logprobs
        logprobs: list[TokenLogprob] | None = [] if want_logprobs is not None else None
        async for out in self._outputs(req, params):
            completion = out.outputs[0]
            if not ids:
                batch_started = time.monotonic()
            ids.extend(completion.token_ids)
            text.append(completion.text)
            if logprobs is not None and want_logprobs is not None:
                logprobs += _logprobs(completion.token_ids, completion.logprobs or [], want_logprobs)
            if out.finished:
                yield TokenBatch(
                    token_ids=ids,
                    text="".join(text),
                    logprobs=logprobs,
                    finish_reason="length" if completion.finish_reason == "length" else "stop",
                    stop_reason=completion.stop_reason if isinstance(completion.stop_reason, str) else None,
                    num_prompt_tokens=len(req.prompt_token_ids),
                    num_cached_tokens=int(out.num_cached_tokens or 0),
                    replica_id=self.replica_id,
                    node_id=self.node_id,
                    # Set only by an engine with KV readback on, for a request given connector params.
                    pinned_kv=out.kv_transfer_params or None,
                )
                return
            if ids and (
                not first_sent or len(ids) >= max_batch or time.monotonic() - batch_started >= max_wait
            ):
                yield TokenBatch(
                    token_ids=ids, text="".join(text), replica_id=self.replica_id, logprobs=logprobs
                )
                first_sent = True
                ids, text = [], []
                logprobs = [] if logprobs is not None else None
        raise RuntimeError(f"engine stream for {req.request_id} ended without a finished output")

    async def export(self, req: EngineRequest) -> dict[str, Any] | None:
        """KV export (decode engines, readback on): pin the prompt's blocks for a prefill engine to pull, and
        say where (vLLM's params; None: the engine pinned nothing). The prompt is a prefix this engine holds
        in its prefix cache plus one token: a one-token request that computes that token and, finishing
        with connector params, leaves its blocks pinned for the TTL (or until read)."""
        final = await self._one_token(req, dict(PIN_ONLY_KV_PARAMS))
        return final.kv_transfer_params or None

    async def _one_token(self, req: EngineRequest, kv: dict[str, Any]) -> Any:
        """Run a one-token request with connector params to its end; vLLM's final output. ignore_eos and no
        stop strings make it always finish by length, the case in which vLLM keeps its KV for a transfer."""
        sampling = Sampling(max_tokens=1, temperature=0.0, ignore_eos=True)
        final = None
        async for out in self._outputs(req, self._sampling_params(sampling, kv)):
            final = out
        if final is None:
            raise RuntimeError(f"{req.request_id} produced no output")
        return final

    async def _outputs(self, req: EngineRequest, params: Any) -> AsyncGenerator[Any, None]:
        """vLLM's outputs for one request; an engine that died or hung raises ReplicaFailed, which the router
        answers by moving the request to another replica."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if (reason := self.failure()) is not None:
            raise ReplicaFailed(self.replica_id, reason)
        if self._inflight == 0:
            self._busy_since = time.monotonic()
        self._inflight += 1
        outputs = self._llm.generate(
            {"prompt_token_ids": req.prompt_token_ids}, params, request_id=req.request_id
        ).__aiter__()
        # A hung engine raises nothing: the request waits on the failure too (see `failure`).
        failed = asyncio.ensure_future(self._failed.wait())
        step: asyncio.Future[Any] | None = None
        try:
            while True:
                step = asyncio.ensure_future(anext(outputs))
                await asyncio.wait((step, failed), return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    step.cancel()
                    raise ReplicaFailed(self.replica_id, self.failure() or "its engine failed")
                try:
                    out = step.result()
                except StopAsyncIteration:
                    return
                yield out
        except EngineDeadError:
            reason = self.failure() or "its vLLM engine core died"
            log.error("%s engine %s failed: %s", self.spec.role, self.replica_id, reason)
            raise ReplicaFailed(self.replica_id, reason) from None
        finally:
            # Cancelled (the client left) or failed: cancelling vLLM's stream aborts the request there.
            if step is not None and not step.done():
                step.cancel()
            failed.cancel()
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
            if self._failure is not None:
                self._failed.set()  # requests waiting on a hung engine give up (see `_outputs`)
        return self._failure

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    async def release(self, kv_transfer_params: dict[str, Any]) -> bool:
        """Tell a prefill engine to free the KV it keeps for a decode that will never pull it (the request
        was cancelled, expired or moved before its decode leg reached an engine); without this the blocks
        stay held until vLLM's KV lease runs out (30 s). False: this engine was handed that request itself,
        and vLLM's abort path has told the prefill engine already."""
        if (reason := self.failure()) is not None:
            raise ReplicaFailed(self.replica_id, reason)
        remote_id = str(kv_transfer_params.get("remote_request_id", ""))
        if not self._hand(remote_id):
            return False
        # vLLM's own hook for a transfer the serving layer rejected: a request aborted before it is
        # scheduled, whose connector notifies the prefill engine without reading.
        await self._llm.notify_kv_transfer_request_rejected(f"release-{remote_id}", kv_transfer_params)
        if self._inflight == 0:
            # The notification goes out at an engine step, and the first one to a prefill engine only once
            # the NIXL handshake with it is done: an idle engine has no next step, so make a few.
            task = asyncio.get_running_loop().create_task(self._step_soon(remote_id))
            self._kicks.add(task)
            task.add_done_callback(self._kicks.discard)
        return True

    async def _step_soon(self, tag: str) -> None:
        """A few one-token engine steps over the next seconds (a one-token prompt caches no block)."""
        for i, delay in enumerate(_KICK_DELAYS_S):
            await asyncio.sleep(delay)
            req = EngineRequest(
                request_id=f"step-{tag}-{i}", prompt_token_ids=[0], sampling=Sampling(max_tokens=1)
            )
            try:
                async for _ in self._outputs(req, self._sampling_params(req.sampling, None)):
                    pass
            except ReplicaFailed:
                return  # the replica is being replaced: its failure is reported by the watchdog

    def _hand(self, remote_request_id: str) -> bool:
        """Record that the prefill request's KV has been handed to this engine; False if it already was."""
        if not remote_request_id or remote_request_id in self._handed:
            return False
        self._handed[remote_request_id] = None
        if len(self._handed) > _HANDED_KEPT:
            self._handed.popitem(last=False)
        return True

    def _sampling_params(self, s: Sampling, kv_transfer_params: dict[str, Any] | None) -> Any:
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
            requests_finished=c.requests_finished,
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
        )

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


def _logprobs(token_ids: list[int], per_token: list[dict[int, Any]], k: int) -> list[TokenLogprob]:
    """vLLM's per-token logprob dicts (the sampled token and the top k, by rank) as messages."""
    out = []
    for token_id, ranked in zip(token_ids, per_token, strict=True):
        chosen = ranked[token_id]
        top = sorted(
            (lp.rank, tid, lp.decoded_token or "", lp.logprob) for tid, lp in ranked.items() if lp.rank <= k
        )
        out.append(
            TokenLogprob(
                token_id=token_id,
                token=chosen.decoded_token or "",
                logprob=chosen.logprob,
                top=[(tid, tok, lp) for _, tid, tok, lp in top],
            )
        )
    return out
