"""Legs reach a prefill replica in decision order, unless the one ahead takes longer than max_wait_s."""

from __future__ import annotations

import asyncio

from router.legs.leg_order import LegOrder


async def test_a_leg_goes_after_the_legs_decided_before_it_for_its_replica() -> None:
    order = LegOrder()
    first, second, other = order.take("p0"), order.take("p0"), order.take("p1")
    sent: list[str] = []

    async def send(name: str, ticket) -> None:  # type: ignore[no-untyped-def]
        await ticket.turn()
        sent.append(name)
        ticket.sent()

    waiting = asyncio.create_task(send("second", second))
    await send("other", other)  # another replica's legs do not wait
    await asyncio.sleep(0.01)
    assert sent == ["other"]
    await first.turn()
    first.sent()
    await waiting
    assert sent == ["other", "second"] and len(order) == 0


async def test_a_leg_waits_at_most_max_wait_s_for_the_one_ahead() -> None:
    order = LegOrder(max_wait_s=0.05)
    order.take("p0")  # never sent
    await asyncio.wait_for(order.take("p0").turn(), 1.0)


async def test_sent_is_idempotent_and_forgets_only_its_own_ticket() -> None:
    order = LegOrder()
    first, second = order.take("p0"), order.take("p0")
    first.sent()
    first.sent()
    assert len(order) == 1  # second is still the replica's latest
    second.sent()
    assert len(order) == 0
