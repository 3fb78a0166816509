"""The skill-event bus: in-process delivery, and the Redis stream between a worker's bus and a server's, with
its wire format, read-from-last-id after an outage, trimming (then a Resync at once) and the periodic Resync."""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import pytest
import redis

from skillpool.trainer.bus import LocalEventBus, RedisEventBus, make_event_bus
from skillpool.trainer.events import (
    Resync,
    SkillActivated,
    SkillEvent,
    SkillRegistered,
    SkillRetired,
    from_wire,
    to_wire,
)
from tests.conftest import until


def _prefix() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def test_a_local_bus_hands_every_event_to_every_subscriber_and_a_failing_one_stops_nothing() -> None:
    bus = make_event_bus(None)
    assert isinstance(bus, LocalEventBus)
    seen: list[SkillEvent] = []

    def broken(event: SkillEvent) -> None:
        raise RuntimeError("handler bug")

    bus.subscribe(broken)
    bus.subscribe(seen.append)
    bus.publish(SkillRetired("a"))  # returns: the handler's error is logged, not the publisher's
    bus.publish(SkillActivated("a", 2))
    assert seen == [SkillRetired("a"), SkillActivated("a", 2)]  # at once, in the publisher's thread
    bus.close()
    bus.publish(SkillRetired("a"))
    assert len(seen) == 2


def test_events_keep_their_wire_format_and_unknown_types_are_skipped() -> None:
    """Servers of this and the previous release follow one stream: the JSON spelling is unchanged."""
    for event, wire in [
        (SkillRegistered("a", 3), {"type": "skill_registered", "name": "a", "version": 3}),
        (SkillRetired("a"), {"type": "skill_retired", "name": "a"}),
        (SkillActivated("b", 2), {"type": "skill_activated", "name": "b", "version": 2}),
        (Resync(), {"type": "resync"}),
    ]:
        assert json.loads(to_wire(event)) == wire and from_wire(json.dumps(wire)) == event
    assert from_wire(json.dumps({"type": "skill_renamed", "name": "a"})) is None
    assert from_wire(json.dumps({"type": "skill_registered", "name": "a", "version": "4"})) == SkillRegistered("a", 4)


def test_a_workers_bus_reaches_a_servers_bus_on_the_same_stream_as_before(redis_url: str) -> None:
    prefix = _prefix()
    server, worker = RedisEventBus(redis_url, prefix), RedisEventBus(redis_url, prefix)
    seen: list[SkillEvent] = []
    try:
        worker.publish(SkillRegistered("a", 1))  # after the server's bus was built, before it subscribed
        server.subscribe(seen.append)
        worker.publish(SkillRetired("a"))
        until(lambda: len(seen) == 2, timeout=10)
        assert seen == [SkillRegistered("a", 1), SkillRetired("a")]
        # the previous release's key and entry: a server of either release reads what the other writes
        r = redis.Redis.from_url(redis_url, decode_responses=True)
        entries = r.xrange(f"{prefix}:events")
        assert [json.loads(fields["event"]) for _, fields in entries][-1] == {"type": "skill_retired", "name": "a"}
        r.xadd(f"{prefix}:events", {"event": json.dumps({"type": "skill_activated", "name": "a", "version": 1})})
        until(lambda: len(seen) == 3, timeout=10)
        assert seen[2] == SkillActivated("a", 1)
    finally:
        server.close()
        worker.close()


class _Cut:
    """While `on` is set, a bus's reads fail as if its connection were down (Redis and the other buses are not);
    `failed` counts the reads that failed so."""

    def __init__(self, bus: RedisEventBus) -> None:
        self.on, self.failed = threading.Event(), 0
        bus.r.xread = self._failing(bus.r.xread)  # type: ignore[method-assign]
        bus.r.xrange = self._failing(bus.r.xrange)  # type: ignore[method-assign]

    def _failing(self, real: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            if self.on.is_set():
                self.failed += 1
                raise redis.ConnectionError("connection lost")
            return real(*a, **kw)

        return call

    def tried_again(self) -> None:
        """Wait until the listener's next read fails: it is cut off, and it tried after all that came before."""
        before = self.failed
        until(lambda: self.failed > before, timeout=10)


def test_skill_events_published_while_a_server_cannot_read_reach_it_later(redis_url: str) -> None:
    prefix = _prefix()
    seen: list[SkillEvent] = []
    server = RedisEventBus(redis_url, prefix, resync_s=3600)
    other = RedisEventBus(redis_url, prefix)
    cut = _Cut(server)
    server.subscribe(seen.append)
    try:
        other.publish(SkillRegistered("a", 1))
        until(lambda: len(seen) == 1, timeout=10)
        cut.on.set()
        cut.tried_again()
        other.publish(SkillRetired("a"))
        other.publish(SkillActivated("b", 2))
        cut.tried_again()  # a read after both were published
        assert len(seen) == 1
        cut.on.clear()
        until(lambda: len(seen) == 3, timeout=10)
        assert seen[:3] == [SkillRegistered("a", 1), SkillRetired("a"), SkillActivated("b", 2)]
        assert Resync() not in seen  # nothing was trimmed: the missed events are enough
    finally:
        server.close()
        other.close()


def test_a_stream_trimmed_past_what_a_server_saw_makes_it_resync_at_once(redis_url: str) -> None:
    prefix = _prefix()
    seen: list[SkillEvent] = []
    server = RedisEventBus(redis_url, prefix, resync_s=3600)  # no periodic resync within this test
    worker = RedisEventBus(redis_url, prefix, maxlen=10)
    cut = _Cut(server)
    server.subscribe(seen.append)
    try:
        worker.publish(SkillRegistered("a", 1))
        until(lambda: seen == [SkillRegistered("a", 1)], timeout=10)
        cut.on.set()
        cut.tried_again()  # no read in flight that could take the entries before they are trimmed
        for version in range(2, 502):  # approximate trimming drops whole stream nodes (100 entries each)
            worker.publish(SkillRegistered("a", version))
        r = redis.Redis.from_url(redis_url, decode_responses=True)
        assert r.xlen(f"{prefix}:events") < 500  # trimmed as published
        cut.on.clear()
        until(lambda: Resync() in seen, timeout=10)
        assert seen.index(Resync()) == 1  # before the entries left: the store says what the trimmed ones did
        until(lambda: seen[-1] == SkillRegistered("a", 501), timeout=10)
        assert seen.count(Resync()) == 1  # once for one trim, however long the outage
    finally:
        server.close()
        worker.close()


def test_the_listener_resyncs_periodically(redis_url: str) -> None:
    """The stream is trimmed, so the listener also asks for a periodic resync with the store."""
    seen: list[SkillEvent] = []
    bus = RedisEventBus(redis_url, _prefix(), resync_s=0.2)
    bus.subscribe(seen.append)
    try:
        until(lambda: seen.count(Resync()) >= 2, timeout=10)
    finally:
        bus.close()


def test_an_unreachable_redis_stops_the_bus_at_start() -> None:
    with pytest.raises(ConnectionError, match="cannot reach Redis"):
        RedisEventBus("redis://127.0.0.1:1/0")
