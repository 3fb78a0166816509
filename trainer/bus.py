"""The skill-event bus: how every server hears that a skill was registered, retired or rolled back.

Built once at start-up (`make_event_bus`): `LocalEventBus` without Redis (one server, its own trainer),
`RedisEventBus` with --redis-url. Publishers: a worker after it stored a skill (SkillRegistered), the admin API on
retire (SkillRetired) and rollback (SkillActivated); subscribers: every server's skill pool.

The Redis bus is a stream (`<prefix>:events`, trainer.keys; one JSON event an entry, trainer.events) that each
server reads from the last id it saw, so one that was disconnected gets what it missed when it is back. The
stream is trimmed to about `maxlen` entries, so the listener also hands its subscribers Resync() every
`resync_s`, and at once when it finds the stream trimmed past the last id it saw: the server then serves
exactly what the store says.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import redis

from skillpool.adapters_store.store import SkillRecord

from .events import Resync, SkillEvent, SkillRegistered, from_wire, to_wire
from .keys import DEFAULT_PREFIX, RedisKeys

log = logging.getLogger(__name__)

EVENTS_MAXLEN = 10_000  # events kept in the stream (approximately); older ones are covered by the resync
Subscriber = Callable[[SkillEvent], None]


class SkillEventBus(Protocol):
    def publish(self, event: SkillEvent) -> None: ...

    def subscribe(self, callback: Subscriber) -> None:
        """Hand `callback` every event from now on; the first subscriber starts the listener."""
        ...

    def close(self) -> None:
        """Stop the listener (publishing stays possible)."""
        ...


def _deliver(subscribers: list[Subscriber], event: SkillEvent) -> None:
    for callback in list(subscribers):
        try:
            callback(event)
        except Exception:  # one failing handler neither stops the others nor fails the publisher
            log.exception("skill event handler failed for %s", event)


class LocalEventBus:
    """One process: publish hands the event to every subscriber at once, in the publisher's thread."""

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []

    def publish(self, event: SkillEvent) -> None:
        _deliver(self._subscribers, event)

    def subscribe(self, callback: Subscriber) -> None:
        self._subscribers.append(callback)

    def close(self) -> None:
        self._subscribers.clear()


class RedisEventBus:
    """The events stream under `prefix`: the same key and entries as the job queue used to write, so a server
    and a worker of the previous release follow one stream."""

    def __init__(
        self, url: str, prefix: str = DEFAULT_PREFIX, resync_s: float = 60.0, maxlen: int = EVENTS_MAXLEN
    ) -> None:
        # timeouts: a Redis that hangs (not refuses) must not hold a handler for long
        self.r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=10, socket_connect_timeout=5)
        try:
            self.r.ping()
        except redis.RedisError as e:
            raise ConnectionError(f"cannot reach Redis at {url}: {e}") from e
        self.key, self.resync_s, self.maxlen = RedisKeys(prefix).events, resync_s, maxlen
        self._subscribers: list[Subscriber] = []
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._last = self._tail()  # built before the store is loaded: what happens from here on is read

    def publish(self, event: SkillEvent) -> None:
        self.r.xadd(self.key, {"event": to_wire(event)}, maxlen=self.maxlen, approximate=True)

    def subscribe(self, callback: Subscriber) -> None:
        self._subscribers.append(callback)
        if self._thread is None:
            self._thread = threading.Thread(target=self._listen, name="skillpool-events", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._closed.set()

    def _tail(self) -> str:
        try:
            last = self.r.xrevrange(self.key, count=1)
        except redis.RedisError:
            return "0-0"  # Redis is down now: read from the start when it is back (the handlers are idempotent)
        return str(last[0][0]) if last else "0-0"

    def _trimmed_past(self, last: str) -> bool:
        """Whether the stream was trimmed past `last`: trimming drops the oldest entries first, so while the entry
        `last` is there every later one is too; once it is gone, some after it may be (a resync too many is
        harmless)."""
        return last != "0-0" and not self.r.xrange(self.key, min=last, max=last, count=1)

    def _listen(self) -> None:
        next_resync = time.monotonic() + self.resync_s
        behind = True  # a read failed or found entries: check for a trim before the next read
        while not self._closed.is_set():
            try:
                trimmed = behind and self._trimmed_past(self._last)  # the entries after it are read next
                behind = False
                if trimmed or time.monotonic() >= next_resync:
                    next_resync = time.monotonic() + self.resync_s
                    _deliver(self._subscribers, Resync())
                reply: Any = self.r.xread({self.key: self._last}, count=100, block=1000)
            except redis.RedisError:
                behind = True
                self._closed.wait(1)  # the next read starts from the last id seen: nothing is lost meanwhile
                continue
            for _stream, entries in reply or []:
                behind = True
                for entry_id, fields in entries:
                    self._last = str(entry_id)
                    try:
                        event = from_wire(fields["event"])
                    except (KeyError, ValueError, TypeError):
                        log.exception("unreadable skill event %s", fields)
                        continue
                    if event is not None:
                        _deliver(self._subscribers, event)


def announcer(
    bus: SkillEventBus, register: Callable[[SkillRecord], None] | None = None
) -> Callable[[SkillRecord], None]:
    """A job queue's `on_success`: serve the stored version in this process (`register`, a server's pool; a
    worker has none), then announce it on the bus so that every server serves it."""

    def stored(record: SkillRecord) -> None:
        if register is not None:
            register(record)
        bus.publish(SkillRegistered(record.name, record.version))

    return stored


def make_event_bus(
    redis_url: str | None, prefix: str = DEFAULT_PREFIX, resync_s: float = 60.0
) -> LocalEventBus | RedisEventBus:
    """The bus a process builds once at start-up: the Redis stream with a URL, else in-process."""
    return RedisEventBus(redis_url, prefix, resync_s) if redis_url else LocalEventBus()
