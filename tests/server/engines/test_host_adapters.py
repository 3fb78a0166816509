"""Adapters read off the engine's loop (server/engines/host_adapters.py): reads start at submit, the loop never
waits on one, host copies are bounded, and a failed read fails only the request that needed it."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from skillpool.adapters_store.objects import StoreUnavailable
from skillpool.lora.mix import Mix
from skillpool.server.engines.host_adapters import HostAdapters
from skillpool.server.engines.residency import SkillResidency
from tests.conftest import until
from tests.server.engines.test_slru import Bank, version
from tests.server.test_engine import Run, make_engine, run


class Gate:
    """A loader that blocks until opened, recording the thread it ran on."""

    def __init__(self, value: Any, fail: bool = False) -> None:
        self.value, self.fail = value, fail
        self.open = threading.Event()
        self.threads: list[str] = []

    def __call__(self) -> Any:
        self.threads.append(threading.current_thread().name)
        assert self.open.wait(30)
        if self.fail:
            raise StoreUnavailable("the adapter store is down")
        return self.value


def test_a_read_runs_off_the_calling_thread_and_is_taken_once_it_ends() -> None:
    woke = threading.Event()
    host = HostAdapters(2, on_ready=woke.set)
    try:
        gate = Gate("weights")
        host.fetch("a#1", gate)
        host.fetch("a#1", gate)  # already being read: not read twice
        assert host.take("a#1") is None and host.loading("a#1")
        gate.open.set()
        assert woke.wait(10)
        assert host.take("a#1") == "weights" and host.take("a#1") == "weights"  # kept as a host copy
        assert gate.threads == ["skillpool-adapter-read"] and host.reads == 1 and len(host) == 1
    finally:
        host.close()


def test_a_failed_read_raises_once_and_the_next_fetch_reads_again() -> None:
    host = HostAdapters(2)
    try:
        bad = Gate(None, fail=True)
        bad.open.set()
        host.fetch("a#1", bad)
        until(lambda: not host.loading("a#1"))
        with pytest.raises(StoreUnavailable):
            host.take("a#1")
        assert host.take("a#1") is None  # forgotten: nothing in flight, nothing kept
        good = Gate("weights")
        good.open.set()
        host.fetch("a#1", good)
        until(lambda: not host.loading("a#1"))
        assert host.take("a#1") == "weights" and host.reads == 2
    finally:
        host.close()


def test_host_copies_and_reads_ahead_are_bounded() -> None:
    host = HostAdapters(2)
    try:
        gates = {k: Gate(f"w{k}") for k in "abcd"}
        for g in gates.values():
            g.open.set()
        for k in "abc":
            host.fetch(k, gates[k])
            until(lambda k=k: not host.loading(k))
            assert host.take(k) == f"w{k}"
        assert len(host) == 2 and host.take("a") is None  # least recently used left first
        held, y, z = Gate("held"), Gate("y"), Gate("z")
        y.open.set()
        z.open.set()
        host.fetch("x", held, ahead=True)
        host.fetch("y", y, ahead=True)
        host.fetch("z", z, ahead=True)  # two pending already, the capacity: not read ahead
        assert not host.loading("z") and host.take("z") is None
        host.fetch("z", gates["d"])  # the request's turn: read whatever is pending
        assert host.reads == 6
        host.drop("x")  # retired while in flight: its result is not kept
        held.open.set()
        assert host.take("x") is None
    finally:
        host.close()


def test_bad_capacity_is_refused() -> None:
    with pytest.raises(ValueError):
        HostAdapters(-1)


def test_residency_waits_for_a_read_and_a_failed_read_evicts_nothing() -> None:
    bank, host = Bank(), HostAdapters(2)
    try:
        res = SkillResidency(bank, max_loaded=1, host=host)  # type: ignore[arg-type]  # membership is all it uses
        slow, broken = Gate("weights of a"), Gate(None, fail=True)
        res.add("a", slow, set())
        res.add("b", broken, set())
        ka, kb = version(res, "a"), version(res, "b")
        res.prefetch(Mix.of({"a": 1.0}))  # at submit: the read starts before admission asks
        until(lambda: slow.threads == ["skillpool-adapter-read"])
        assert not res.ensure([ka], {ka}) and ka not in bank  # still reading: the request waits
        slow.open.set()
        until(lambda: not host.loading(ka))
        assert res.ensure([ka], {ka}) and bank[ka] == "weights of a" and res.loads == 1
        broken.open.set()
        assert not res.ensure([kb], {kb})
        until(lambda: not host.loading(kb))
        with pytest.raises(StoreUnavailable):
            res.ensure([kb], {kb})
        assert list(bank) == [ka]  # the resident skill stayed
        res.remove("a", set())
        assert ka not in bank and host.take(ka) is None  # retired: no host copy either
    finally:
        host.close()


def test_a_skill_being_read_never_stalls_the_rows_that_decode(tiny_base) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(tiny_base, max_loaded_skills=2)
    try:
        want = run(eng, ["Hello there"], [(("one", 1.0),)], max_tokens=8)[0]
        slow = Gate(eng.skills.bank.adapters[version(eng.skills, "one")])
        eng.add_skill("slow", slow)
        long = Run(eng, "Tell me a long story", (("two", 1.0),), max_tokens=40)
        until(lambda: len(long.events) >= 2)
        waiting = Run(eng, "Hello there", (("slow", 1.0),), max_tokens=8)
        # all its tokens come while the other request's skill is being read, on the reading thread
        assert long.result(timeout=20)[1] == "length" and not waiting.done.is_set()
        until(lambda: slow.threads == ["skillpool-adapter-read"])
        slow.open.set()
        assert waiting.result() == want  # the same weights as "one": the same answer
        assert eng.stats()["adapter_loads"] >= 2
    finally:
        eng.close()
