"""The hub's bookkeeping without Ray: commands reach every polling replica in order, a barrier returns once every
live replica has applied a command (and not before), a replica that fell silent is not waited for, one that missed
trimmed commands is told to drop what it holds, and each poll's report adds up."""

from __future__ import annotations

import asyncio

import pytest

from skillpool.server.cluster.hub import SkillHub


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_a_new_replica_starts_at_the_current_number_with_nothing_to_apply() -> None:
    async def go() -> None:
        hub = SkillHub()
        await hub.command("add", "agnews", 1)
        reply = await hub.poll("r1", -1, {}, timeout=0.01)
        assert reply.seq == 1 and reply.commands == () and not reply.resync

    run(go())


def test_commands_reach_a_polling_replica_in_order() -> None:
    async def go() -> None:
        hub = SkillHub()
        first = await hub.poll("r1", -1, {}, timeout=0.01)
        waiting = asyncio.ensure_future(hub.poll("r1", first.seq, {}, timeout=5))
        await asyncio.sleep(0.05)  # it must not return: no event says so, so it gets the loop for a while
        assert not waiting.done()  # a long poll: it waits for a command
        await hub.command("add", "agnews", 2)
        await hub.command("remove", "sst-2")
        reply = await asyncio.wait_for(waiting, 2)
        assert [(c.kind, c.name, c.version) for c in reply.commands] in (
            [("add", "agnews", 2)],
            [("add", "agnews", 2), ("remove", "sst-2", None)],
        )
        rest = await hub.poll("r1", reply.seq, {}, timeout=0.01)
        got = [(c.kind, c.name) for c in reply.commands + rest.commands]
        assert got == [("add", "agnews"), ("remove", "sst-2")] and rest.seq == 2

    run(go())


def test_a_barrier_returns_only_after_every_live_replica_applied_the_command() -> None:
    async def go() -> None:
        hub = SkillHub()
        for r in ("r1", "r2"):
            await hub.poll(r, -1, {}, timeout=0.01)
        seq = await hub.command("remove", "agnews")
        barrier = asyncio.ensure_future(hub.barrier(seq, timeout=5))
        await hub.poll("r1", seq, {}, timeout=0.01)  # r1 applied it
        await asyncio.sleep(0.05)  # it must not return: no event says so, so it gets the loop for a while
        assert not barrier.done()  # r2 has not yet
        await hub.poll("r2", seq, {}, timeout=0.01)
        assert await asyncio.wait_for(barrier, 2) == []

    run(go())


def test_a_barrier_names_the_replicas_that_did_not_confirm_in_time() -> None:
    async def go() -> None:
        hub = SkillHub()
        await hub.poll("r1", -1, {}, timeout=0.01)
        seq = await hub.command("remove", "agnews")
        assert await hub.barrier(seq, timeout=0.1) == ["r1"]

    run(go())


def test_a_silent_replica_is_not_waited_for_and_must_drop_everything_when_back() -> None:
    async def go() -> None:
        hub = SkillHub(stale_s=0.05)
        first = await hub.poll("gone", -1, {}, timeout=0.01)
        await asyncio.sleep(0.1)  # longer than stale_s without a poll: its process died
        seq = await hub.command("remove", "agnews")
        assert await hub.barrier(seq, timeout=1) == []
        assert "gone" not in await hub.replicas()
        back = await hub.poll("gone", first.seq, {}, timeout=0.01)  # it was only slow: it may hold anything
        assert back.resync and back.seq == seq

    run(go())


def test_a_replica_behind_the_trimmed_log_resyncs() -> None:
    async def go() -> None:
        hub = SkillHub(keep=2)
        start = await hub.poll("r1", -1, {}, timeout=0.01)
        for i in range(4):
            await hub.command("add", f"skill-{i}", 1)
        reply = await hub.poll("r1", start.seq, {}, timeout=0.01)
        assert reply.resync and reply.seq == 4 and reply.commands == ()

    run(go())


def test_reports_add_up_per_replica() -> None:
    async def go() -> None:
        hub = SkillHub()
        a = await hub.poll("r1", -1, {"stats": {"running": 1}, "served": {"agnews#v1": 2}}, timeout=0.01)
        await hub.poll("r1", a.seq, {"served": {"agnews#v1": 3, "sst-2#v2": 1}, "versions": {"agnews": 1}}, 0.01)
        view = (await hub.replicas())["r1"]
        assert view["served"] == {"agnews#v1": 5, "sst-2#v2": 1}
        assert view["versions"] == {"agnews": 1} and view["stats"] == {"running": 1}

    run(go())


def test_an_unknown_command_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown command"):
        run(SkillHub().command("retrain", "agnews"))
