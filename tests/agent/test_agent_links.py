"""A node whose processes are killed is left out at the speed of a closed connection, not when
its ZooKeeper session expires (agent/links.py, docs/rendezvous.md).

Three agents as real processes on a ZooKeeper server of the test's own, with torch-free
workers and a session timeout far longer than anything the test waits for: one node's agent
and workers are SIGKILLed, and the survivors' next round must form while the killed agent's
member znode is still there, which only the links can make happen. What is asserted is
order, never time: the events say why the round ended ("connection closed") before the
survivors' round, and the znode is read after that round formed.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest
from kazoo.client import KazooClient
from test_agent_outage import Agents, wait_for

from hpc_elastic import events

SESSION = 40
"""The agents' ``--session-timeout``: the killed node's membership outlives every wait here."""


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (its workers), from ``/proc``."""
    found = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as listed:
                found += [int(child) for child in listed.read().split()]
    return found


def rounds_of(agents: Agents, size: int, after: int = 0) -> list[events.Event]:
    """The ``round`` events of rounds of ``size`` nodes numbered above ``after``."""
    return [
        e
        for e in agents.events()
        if e.kind == "round" and e.details["world_size"] == size and (e.round or 0) > after
    ]


@pytest.mark.parametrize("victim_rank", [2, 0], ids=["a member", "the centre"])
def test_a_node_killed_with_its_workers_is_left_out_before_its_session_expires(
    tmp_path: Path, private_zookeeper: str, victim_rank: int
) -> None:
    """The killed node is a member (only the centre, group rank 0, holds a link to it) or
    the centre itself (every other member holds one)."""
    chroot = f"{private_zookeeper}/links-{victim_rank}"
    agents = Agents(tmp_path, chroot, "2:3", **{"session-timeout": str(SESSION)})
    client = KazooClient(hosts=chroot, timeout=10)
    try:
        for slot in ("a0", "a1", "a2"):
            agents.start(slot)
        wait_for(lambda: bool(rounds_of(agents, 3)), "a round of three")
        first = rounds_of(agents, 3)[-1]
        members = [str(slot) for slot in first.details["members"]]
        victim = members[victim_rank]
        wait_for(
            lambda: sum(e.kind == "start" and e.round == first.round for e in agents.events()) == 3,
            "every node start its workers",
        )
        victim_id = next(
            str(e.details["node_id"])
            for e in agents.events()
            if e.kind == "join" and e.slot == victim
        )
        # The links are evidence once they are up at both ends; a node killed before that is
        # left out when its session expires (a link refused or reset while it was being made
        # proves nothing). The centre accepts a link from each member; a member makes one to the
        # centre. A member's link is up at the centre when the centre has sent its answer, and at
        # the member once the member has read it: killed in between, the member's kernel finds
        # the answer unread and resets the link (RST, no evidence), so both ends are waited for.
        centre_id = next(
            str(e.details["node_id"])
            for e in agents.events()
            if e.kind == "join" and e.slot == members[0]
        )
        ends = (
            [(members[0], f"link from {victim_id}"), (victim, f"link to {centre_id}")]
            if victim_rank
            else [(slot, f"link to {victim_id}") for slot in members[1:]]
        )
        wait_for(
            lambda: all(
                f"{line} for round {first.round} up" in agents.log(slot) for slot, line in ends
            ),
            "the links between the victim and the survivors up at both ends",
        )
        agent_pid = agents.procs[victim].pid
        workers = children(agent_pid)
        assert workers, "the victim's workers are running"
        os.kill(agent_pid, signal.SIGKILL)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda: bool(rounds_of(agents, 2, first.round or 0)), "the survivors' round")
        client.start()
        still_there = client.exists(f"/hpc-elastic/run/members/{victim_id}") is not None
        # Read before the teardown: killing the survivors one by one is a departure too.
        history = agents.events()
    finally:
        client.stop()
        client.close()
        agents.kill_all()
    assert still_there, "the round formed only after the killed agent's session expired"
    survivors_round = next(
        e
        for e in history
        if e.kind == "round"
        and e.details["world_size"] == 2
        and (e.round or 0) > (first.round or 0)
    )
    assert survivors_round.details["members"] == [slot for slot in members if slot != victim]
    departed = [e for e in history if e.kind == "departed"]
    assert departed, [e.kind for e in history]
    assert {(e.round, e.details["node"], e.details["cause"]) for e in departed} == {
        (first.round, victim, "connection closed")
    }
    assert history.index(departed[0]) < history.index(survivors_round)
    assert victim not in {e.slot for e in departed}, "told by the others, not by itself"
