"""KV-aware routing on real engines: one prefill and two decode vLLM replicas, the router fed by the
engines' own KV events. An agent session's next turn goes to the decode replica holding its previous
turn, which reports the prefix as cached and prefills only the new suffix itself (no prefill hop). With KV
readback on, a turn that does need the prefill hop pulls what the prefill replica lacks of the session's
context from the decode replica over NIXL instead of computing it."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from e2e_support import RunningCluster, cluster_up, make_topology
from ports import free_port

from pdserve_client.api import pdserve_pb2 as pb
from pdserve_client.sdk import Completion, PdserveClient

pytestmark = pytest.mark.e2e

BLOCK = 32
SYSTEM = "You are a coding agent. Use the tools to inspect the repository before answering. " * 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    topology = make_topology(
        tmp_path_factory.mktemp("kv"),
        pools__decode__replicas=2,
        pools__kv_readback_ttl_s=480,
        server__http_port=free_port(),
    )
    with cluster_up(topology) as running:
        yield running


@pytest.fixture(scope="module")
def client(cluster: RunningCluster) -> Iterator[PdserveClient]:
    c = PdserveClient(cluster.target, timeout=180)
    # Both decode replicas registered with the router before the first turn.
    deadline = time.monotonic() + 60
    while sum(r.role == "decode" for r in c.cluster_status()) < 2 and time.monotonic() < deadline:
        time.sleep(1)
    yield c
    c.close()


def metric(cluster: RunningCluster, name: str, **labels: str) -> float:
    want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    with urllib.request.urlopen(cluster.metrics_url, timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + want + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def conversation(turns: int) -> list[dict[str, object]]:
    messages: list[dict[str, object]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Find where the router hashes blocks."},
    ]
    for t in range(turns - 1):
        call = f"call_{t}"
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": call, "name": "grep", "arguments": {"q": "hash"}}],
            }
        )
        messages.append(
            {"role": "tool", "tool_call_id": call, "content": f"router/block_hash.py:{t}: def hash_blocks"}
        )
    return messages


def test_next_turn_goes_to_the_decode_replica_holding_the_session_and_skips_prefill(
    cluster: RunningCluster, client: PdserveClient
) -> None:
    sticky_before = metric(cluster, "pdserve_routing_decisions_total", reason="affinity_local_prefill")
    first = client.generate_text(
        messages=conversation(1), session_id="agent-1", max_tokens=8, temperature=0.0
    )
    assert first.served_by.path == pb.SERVING_PATH_DISAGGREGATED  # a cold prompt: prefill, then NIXL
    prompt_blocks = first.usage.prompt_tokens // BLOCK
    assert prompt_blocks >= 10
    time.sleep(1.0)  # the agent's tool call; the engines' KV events reach the router meanwhile
    cache_metrics = (
        "pdserve_cached_tokens_total",
        "pdserve_predicted_cached_tokens_total",
        "pdserve_cache_prediction_error_tokens_count",
    )
    before = [metric(cluster, name) for name in cache_metrics]

    second = client.generate_text(
        messages=conversation(2), session_id="agent-1", max_tokens=8, temperature=0.0
    )
    assert second.served_by.decode_replica == first.served_by.decode_replica
    # The session's turn was tokenized incrementally (only the appended messages): the same ids as a full
    # tokenization of the conversation.
    assert second.usage.prompt_tokens == len(client.tokenize(messages=conversation(2)).token_ids)
    # The decode replica held all but the new suffix: it prefilled locally, no prefill leg, no KV moved.
    assert second.served_by.path == pb.SERVING_PATH_LOCAL_PREFILL
    assert second.served_by.prefill_replica == ""
    assert second.usage.kv_transferred_tokens == 0
    # ... and the router counted why.
    sticky = metric(cluster, "pdserve_routing_decisions_total", reason="affinity_local_prefill")
    assert sticky - sticky_before == 1
    # The engine itself reports the previous turn's prefix as cached, and the router predicted it.
    assert second.usage.cached_tokens >= (prompt_blocks - 1) * BLOCK
    assert second.usage.predicted_cached_tokens >= (prompt_blocks - 1) * BLOCK
    assert abs(second.usage.predicted_cached_tokens - second.usage.cached_tokens) <= BLOCK
    # Both are exported per request, so drift between the router's index and the engine shows on /metrics.
    after = [metric(cluster, name) for name in cache_metrics]
    assert [a - b for a, b in zip(after, before, strict=True)] == [
        second.usage.cached_tokens,
        second.usage.predicted_cached_tokens,
        1,
    ]


def test_every_turn_of_a_session_stays_on_one_decode_replica(client: PdserveClient) -> None:
    served = []
    for turns in (1, 2, 3):
        done = client.generate_text(
            messages=conversation(turns), session_id="agent-2", max_tokens=4, temperature=0.0
        )
        served.append(done.served_by.decode_replica)
        time.sleep(1.0)
    assert len(set(served)) == 1


def test_a_token_id_session_reuses_its_previous_turns_ids_and_is_served_as_a_full_request(
    cluster: RunningCluster, client: PdserveClient
) -> None:
    ids1 = list(client.tokenize(messages=conversation(1)).token_ids)
    first = client.generate_text(token_ids=ids1, session_id="agent-ids", max_tokens=8, temperature=0.0)
    time.sleep(1.0)
    reused_before = metric(cluster, "pdserve_token_id_prompt_tokens_total", source="reused")
    ids2 = ids1 + list(range(100, 164))  # the tool result, as ids
    second = client.generate_text(token_ids=ids2, session_id="agent-ids", max_tokens=8, temperature=0.0)
    # The router took turn 1's ids from its session (the request's ids extend them on the wire).
    assert metric(cluster, "pdserve_token_id_prompt_tokens_total", source="reused") - reused_before == len(
        ids1
    )
    assert second.usage.prompt_tokens == len(ids2)
    assert second.served_by.decode_replica == first.served_by.decode_replica
    assert second.usage.cached_tokens >= (len(ids1) // BLOCK - 1) * BLOCK
    # The same ids without a session (converted in full) give the same greedy reply.
    alone = client.generate_text(token_ids=ids2, max_tokens=8, temperature=0.0)
    assert second.token_ids == alone.token_ids


def prefill_external_kv(client: PdserveClient) -> int:
    return sum(r.prompt_tokens_external_kv for r in client.cluster_status() if r.role == "prefill")


def tool_results(seed: int) -> Callable[[int], list[int]]:
    rng = random.Random(seed)
    return lambda n: [rng.randrange(100, 1000) for _ in range(n)]


def second_turn_on_decode(
    client: PdserveClient, session_id: str, tool_result: Callable[[int], list[int]]
) -> tuple[list[int], list[int], Completion]:
    """Turn 1 (a long tool result) prefilled on the prefill replica, turn 2 (a short one) on the decode
    replica itself, which the prefill replica then lacks. Returns both prompts and turn 2's reply."""
    ids1 = tool_result(600)
    first = client.generate_text(token_ids=ids1, session_id=session_id, max_tokens=8, temperature=0.0)
    assert first.served_by.path == pb.SERVING_PATH_DISAGGREGATED  # the prefill replica now holds ids1
    time.sleep(1.0)
    ids2 = ids1 + list(first.token_ids) + tool_result(150)
    second = client.generate_text(token_ids=ids2, session_id=session_id, max_tokens=8, temperature=0.0)
    assert second.served_by.path == pb.SERVING_PATH_LOCAL_PREFILL
    time.sleep(1.0)
    return ids1, ids2, second


def test_a_prefill_leg_pulls_the_sessions_context_from_its_decode_replica(
    cluster: RunningCluster, client: PdserveClient
) -> None:
    tool_result = tool_results(7)
    # Turn 2's decode replica keeps the turn's KV pinned.
    ids1, ids2, second = second_turn_on_decode(client, "agent-rb", tool_result)
    pulled_before = prefill_external_kv(client)
    decode = second.served_by.decode_replica
    predicted_before = metric(cluster, "pdserve_kv_readback_tokens_total", decode_replica=decode)
    # A long one: the prefill hop. The prefill replica holds ids1; the rest of turn 2's context (its reply,
    # the tool result, turn 2's reply) it pulls from the decode replica instead of computing it.
    ids3 = ids2 + list(second.token_ids) + tool_result(600)
    third = client.generate_text(token_ids=ids3, session_id="agent-rb", max_tokens=8, temperature=0.0)
    assert third.served_by.path == pb.SERVING_PATH_DISAGGREGATED
    predicted = metric(cluster, "pdserve_kv_readback_tokens_total", decode_replica=decode) - predicted_before
    # Whole blocks from the end of ids1's blocks to the end of what turn 2's request computed.
    assert predicted == (len(ids2) + 7) // BLOCK * BLOCK - len(ids1) // BLOCK * BLOCK
    # The prefill engine reports what it pulled (its stats reach the registry with the next heartbeat).
    deadline = time.monotonic() + 30
    while prefill_external_kv(client) == pulled_before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert prefill_external_kv(client) - pulled_before == predicted
    # What the prefill engine did not compute (its own prefix + the pull) is what the router predicted.
    assert abs(third.usage.cached_tokens - third.usage.predicted_cached_tokens) <= BLOCK
    assert third.usage.cached_tokens >= len(ids1) // BLOCK * BLOCK + predicted - BLOCK
    # Pulled KV is the same KV: the same ids without a session give the same greedy reply.
    alone = client.generate_text(token_ids=ids3, max_tokens=8, temperature=0.0)
    assert third.token_ids == alone.token_ids


def test_a_prefix_cached_only_on_a_decode_replica_is_exported_to_a_prefill_leg(
    cluster: RunningCluster, client: PdserveClient
) -> None:
    tool_result = tool_results(11)
    ids1, ids2, second = second_turn_on_decode(client, "agent-ex", tool_result)  # only decode holds ids2
    exported_before = metric(cluster, "pdserve_kv_exports_total", outcome="pinned")
    pulled_before = prefill_external_kv(client)
    # Without a session there is no pinned turn to read back: the router has the decode replica pin the
    # prefix it caches (an export), and the prefill leg pulls it instead of computing it.
    ids3 = ids2 + list(second.token_ids) + tool_result(600)
    third = client.generate_text(token_ids=ids3, max_tokens=8, temperature=0.0)
    assert third.served_by.path == pb.SERVING_PATH_DISAGGREGATED
    assert metric(cluster, "pdserve_kv_exports_total", outcome="pinned") - exported_before == 1
    deadline = time.monotonic() + 30
    while prefill_external_kv(client) == pulled_before and time.monotonic() < deadline:
        time.sleep(0.5)
    pulled = prefill_external_kv(client) - pulled_before
    # The prefill replica held ids1's blocks; it pulled the rest of the decode replica's cached prefix.
    assert pulled >= (len(ids2) // BLOCK - len(ids1) // BLOCK) * BLOCK
    assert abs(third.usage.cached_tokens - third.usage.predicted_cached_tokens) <= BLOCK
    # Pulled KV is the same KV: the same ids again give the same greedy reply.
    again = client.generate_text(token_ids=ids3, max_tokens=8, temperature=0.0)
    assert third.token_ids == again.token_ids


GREP = {
    "name": "grep",
    "description": "Search the repository",
    "parameters": {
        "type": "object",
        "properties": {"pattern": {"enum": ["hash", "route", "prefill"]}},
        "required": ["pattern"],
        "additionalProperties": False,
    },
}


def test_an_agent_loop_of_tool_calls_stays_where_its_cache_is(client: PdserveClient) -> None:
    """The agent's loop: the model calls a tool, the agent runs it and sends the call and its result back
    with the whole conversation; the next turn lands on the decode replica holding the previous one."""
    messages: list[dict[str, object]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Where does the router hash blocks?"},
    ]
    first = client.generate_text(
        messages=messages,
        tools=[GREP],
        tool_choice="required",
        parallel_tool_calls=False,
        session_id="agent-loop",
        max_tokens=64,
        temperature=0.0,
    )
    assert first.finish_reason == "tool_calls"
    (call,) = first.tool_calls
    assert call["name"] == "grep" and json.loads(call["arguments"])["pattern"] in ("hash", "route", "prefill")
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "router/block_hash.py:12: def hash_blocks"},
    ]
    time.sleep(1.0)  # the tool runs; the engines' KV events reach the router
    second = client.generate_text(
        messages=messages, tools=[GREP], session_id="agent-loop", max_tokens=8, temperature=0.0
    )
    assert second.served_by.decode_replica == first.served_by.decode_replica
    assert second.usage.cached_tokens >= (first.usage.prompt_tokens // BLOCK - 1) * BLOCK


def test_an_http_session_stays_where_its_cache_is(cluster: RunningCluster, client: PdserveClient) -> None:
    """The OpenAI door's session id (the X-Session-Id header) reaches the same router path as gRPC's."""
    import openai

    http = openai.OpenAI(
        base_url=f"{cluster.http_url}/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"X-Session-Id": "web-1"},
    )
    messages: list[dict[str, object]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which file routes requests?"},
    ]
    first = http.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=8, temperature=0.0)  # type: ignore[arg-type]
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And which one hashes blocks?"},
    ]
    time.sleep(1.0)
    second = http.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=8, temperature=0.0
    )  # type: ignore[arg-type]
    served = [(r.model_extra or {})["pdserve"]["decode_replica"] for r in (first, second)]
    assert served[0] and served[0] == served[1]
    assert (
        first.usage is not None
        and second.usage is not None
        and second.usage.prompt_tokens_details is not None
    )
    assert (
        second.usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens // BLOCK - 1) * BLOCK
    )


def test_a_router_setting_applied_to_the_running_cluster_changes_the_next_decisions_without_a_restart(
    cluster: RunningCluster, client: PdserveClient, tmp_path: Path
) -> None:
    """`pdserve apply` of `router.mode: disaggregate`: a session's next turn, which the running router would
    prefill on its decode replica, takes the prefill hop instead; no engine replica restarts. (Last in this
    module: it leaves the router in that mode.)"""
    engines = sorted((r.replica_id, r.role) for r in client.cluster_status())
    first = client.generate_text(
        messages=conversation(1), session_id="apply-1", max_tokens=8, temperature=0.0
    )
    time.sleep(1.0)
    before = client.generate_text(
        messages=conversation(2), session_id="apply-1", max_tokens=8, temperature=0.0
    )
    assert before.served_by.path == pb.SERVING_PATH_LOCAL_PREFILL
    assert before.served_by.decode_replica == first.served_by.decode_replica

    topo = yaml.safe_load(cluster.topology.read_text())
    topo["router"]["mode"] = "disaggregate"
    changed = tmp_path / "disaggregate.yaml"
    changed.write_text(yaml.safe_dump(topo))
    applied = cluster.cli("apply", "-f", str(changed))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert "router.mode: auto -> disaggregate" in applied.stdout
    assert "registry: records the new topology (reconfigured in place)" in applied.stdout
    assert all(
        line.endswith("unchanged")
        for line in applied.stdout.splitlines()
        if line.strip().startswith(("prefill", "decode"))
    )
    deadline = time.monotonic() + 30
    while True:  # the router follows the deployed topology within about a second
        after = client.generate_text(
            messages=conversation(3), session_id="apply-1", max_tokens=8, temperature=0.0
        )
        if after.served_by.path == pb.SERVING_PATH_DISAGGREGATED or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert after.served_by.path == pb.SERVING_PATH_DISAGGREGATED
    assert after.served_by.prefill_replica and after.usage.kv_transferred_tokens > 0
    # The session is still where its KV is: the decode replica and its state were kept.
    assert after.served_by.decode_replica == first.served_by.decode_replica
    assert sorted((r.replica_id, r.role) for r in client.cluster_status()) == engines
