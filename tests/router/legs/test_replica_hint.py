"""The Serve request router that honours pdserve's choice: the hinted replica first, never a replica the
router knows failed (Serve may list it for seconds), and nothing at all rather than a failed one."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ray.serve._private.request_router.common import RequestRoutingContext

from router.legs.replica_hint import ReplicaHintRouter


def replica(rid: str) -> Any:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid))


def ids(ranks: list[list[Any]]) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


async def choose(candidates: list[str], **kwargs: Any) -> list[list[str]]:
    return ids((await choose_pending(candidates, **kwargs))[0])


async def choose_pending(candidates: list[str], **kwargs: Any) -> tuple[list[list[Any]], Any]:
    router = ReplicaHintRouter.__new__(ReplicaHintRouter)  # choose_replicas reads no router state
    pending = SimpleNamespace(kwargs=kwargs, routing_context=RequestRoutingContext())
    ranks = await router.choose_replicas([replica(r) for r in candidates], pending)  # type: ignore[arg-type]
    return ranks, pending


async def test_the_hinted_replica_first_then_the_others() -> None:
    assert await choose(["a", "b", "c"], replica_hint="b") == [["b"], ["a", "c"]]
    assert await choose(["a", "b"]) == [["a", "b"]]


async def test_a_failed_replica_is_never_chosen() -> None:
    assert await choose(["a", "b", "c"], replica_hint="b", replica_avoid=("a",)) == [["b"], ["c"]]
    # The hint is not in Serve's list yet (a replacement Serve has not announced): any usable one.
    assert await choose(["a", "c"], replica_hint="new", replica_avoid=("a",)) == [["c"]]


async def test_with_only_failed_replicas_listed_serve_waits_for_its_list_to_change() -> None:
    ranks, pending = await choose_pending(["a"], replica_hint="new", replica_avoid=("a",))
    assert ids(ranks) == [[]]
    # Serve sleeps between attempts only when told to (its built-in routers say so once they have tried
    # every replica; this one always does). Without it, Serve's routing loop retried at once, forever: its
    # thread held the GIL and the router process stalled every stream (seen in tests/e2e/test_faults.py).
    assert pending.routing_context.should_backoff is True
