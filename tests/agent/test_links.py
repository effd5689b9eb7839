"""The links between the agents of a round (agent/links.py): a killed peer's kernel closes its
link at once, and only that orderly end is taken as its death.

Real sockets between real processes: the test SIGKILLs a process that holds a link and waits
for what the other end reports; what must not be reported is checked once the link is seen
gone (``Links.peers``), never after a fixed sleep.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from lifeline import while_parent_lives

from hpc_elastic.agent.links import LinkEnd, Links, Peer, is_evidence
from hpc_elastic.rendezvous.api import NodeInfo, Round

REPO = Path(__file__).resolve().parents[2]
DEADLINE = 120.0
"""Seconds to wait for what takes milliseconds on an idle machine (a peer process starts
with its imports first, which a loaded machine stretches to many seconds)."""

PEER = """\
import json, sys, time
from hpc_elastic.agent.links import Links
from hpc_elastic.rendezvous.api import NodeInfo, Round
me, role, centre_port = sys.argv[1], sys.argv[2], int(sys.argv[3])
links = Links.open({})
links.start(me, "job", lambda peer: print(json.dumps([peer.node_id, peer.round]), flush=True))
print(json.dumps(links.port), flush=True)
if role == "member":
    centre = NodeInfo("centre", "127.0.0.1", 1, "", centre_port)
    links.hold(Round(1, (centre, NodeInfo(me, "127.0.0.1", 1)), "127.0.0.1", 1, 0, 0))
    while not links.peers():
        time.sleep(0.01)
    print(json.dumps("linked"), flush=True)
"""
"""Another agent's links, in a process of its own: ``member`` links up to the centre at the
given port for round 1 and prints "linked" once it has read the centre's answer; ``centre``
waits for members. Then it waits to be killed, or for the test's process to be gone
(``peer_process``)."""


def wait_for(condition: Callable[[], bool], what: str) -> None:
    ends = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < ends, f"never saw {what} within {DEADLINE:g} s"
        time.sleep(0.01)


class Heard:
    """What a ``Links`` reports departed."""

    def __init__(self) -> None:
        self.peers: list[Peer] = []
        self._lock = threading.Lock()

    def __call__(self, peer: Peer) -> None:
        with self._lock:
            self.peers.append(peer)


@pytest.fixture
def centre() -> Iterator[tuple[Links, Heard]]:
    links = Links.open({})
    assert links is not None
    heard = Heard()
    links.start("centre", "job", heard)
    links.hold(round_of(NodeInfo("centre", "127.0.0.1", 1, "", links.port), member("m")))
    yield links, heard
    links.close()


def member(name: str) -> NodeInfo:
    return NodeInfo(name, "127.0.0.1", 1)


def round_of(*members: NodeInfo, number: int = 1) -> Round:
    return Round(number, members, "127.0.0.1", 1, 0, 0)


def peer_process(name: str, role: str, centre_port: int = 0) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    idle = while_parent_lives("time.sleep(0.1)")
    return subprocess.Popen(
        # Until the test kills it, or a test run killed outright leaves it without its parent.
        [sys.executable, "-c", PEER + idle, name, role, str(centre_port)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_only_an_orderly_end_of_a_link_is_evidence_of_its_peers_death() -> None:
    assert [end for end in LinkEnd if is_evidence(end)] == [LinkEnd.CLOSED]


def test_a_member_killed_with_sigkill_is_reported_departed_by_the_centre(
    centre: tuple[Links, Heard],
) -> None:
    links, heard = centre
    process = peer_process("m", "member", links.port)
    try:
        wait_for(lambda: Peer("m", 1) in links.peers(), "the member's link up")
        # Up at both ends: the centre's answer read, nothing lies unread in the member's
        # buffer. Killed before that, its kernel resets the link (no evidence, by design).
        assert process.stdout is not None
        process.stdout.readline()  # its own port
        assert process.stdout.readline() == json.dumps("linked") + "\n"
        assert heard.peers == []
        process.send_signal(signal.SIGKILL)
        wait_for(lambda: bool(heard.peers), "the member reported departed")
        assert heard.peers == [Peer("m", 1)]
        assert links.peers() == frozenset()
    finally:
        process.kill()
        process.wait()


def test_a_centre_killed_with_sigkill_is_reported_departed_by_its_member() -> None:
    process = peer_process("centre", "centre")
    links = Links.open({})
    assert links is not None
    heard = Heard()
    try:
        assert process.stdout is not None
        port = json.loads(process.stdout.readline())
        links.start("m", "job", heard)
        links.hold(round_of(NodeInfo("centre", "127.0.0.1", 1, "", port), member("m")))
        wait_for(lambda: Peer("centre", 1) in links.peers(), "the link to the centre up")
        process.send_signal(signal.SIGKILL)
        wait_for(lambda: bool(heard.peers), "the centre reported departed")
        assert heard.peers == [Peer("centre", 1)]
    finally:
        links.close()
        process.kill()
        process.wait()


def handshake(port: int, hello: dict[str, object]) -> socket.socket:
    """A link made by hand, as a member's ``Links`` makes it; its answer read."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
    sock.sendall(json.dumps(hello).encode() + b"\n")
    answer = b""
    while not answer.endswith(b"\n"):
        chunk = sock.recv(100)
        if not chunk:
            break
        answer += chunk
    return sock


def test_a_reset_link_is_no_evidence(centre: tuple[Links, Heard]) -> None:
    """A middlebox (or a firewall) can reset the connection of a node that lives on."""
    links, heard = centre
    sock = handshake(links.port, {"run": "job", "round": 1, "from": "m", "to": "centre"})
    wait_for(lambda: Peer("m", 1) in links.peers(), "the hand-made link up")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # with a zero linger: RST, not FIN
    wait_for(lambda: not links.peers(), "the reset link dropped")
    assert heard.peers == []


@pytest.mark.parametrize(
    "hello",
    [
        {"run": "another job", "round": 1, "from": "m", "to": "centre"},
        {"run": "job", "round": 1, "from": "m", "to": "another node"},
        {"run": "job", "round": 0, "from": "m", "to": "centre"},
        {"run": "job", "round": "1", "from": "m", "to": "centre"},
        {"run": "job", "round": 1, "from": "", "to": "centre"},
    ],
)
def test_a_hello_not_for_this_node_and_round_makes_no_link(
    centre: tuple[Links, Heard], hello: dict[str, object]
) -> None:
    links, heard = centre
    sock = handshake(links.port, hello)
    try:
        assert sock.recv(100) == b"", "the centre closes it without an answer"
    finally:
        sock.close()
    assert links.peers() == frozenset()
    assert heard.peers == []


def test_a_member_that_moves_on_to_a_later_round_closes_its_old_link_and_makes_a_new_one(
    centre: tuple[Links, Heard],
) -> None:
    """The old link's end is orderly and is reported (the centre may not hold the later
    round yet): the rendezvous' rule, which sees the round moved on, is what ignores it."""
    links, heard = centre
    mine = Links.open({})
    assert mine is not None
    try:
        mine.start("m", "job", Heard())
        centre_node = NodeInfo("centre", "127.0.0.1", 1, "", links.port)
        mine.hold(round_of(centre_node, member("m")))
        wait_for(lambda: Peer("m", 1) in links.peers(), "round 1's link up")
        mine.hold(round_of(centre_node, member("m"), number=2))
        wait_for(lambda: links.peers() == {Peer("m", 2)}, "round 2's link alone")
        wait_for(lambda: heard.peers == [Peer("m", 1)], "round 1's link reported")
        wait_for(lambda: mine.peers() == {Peer("centre", 2)}, "the member's side of round 2")
        links.hold(round_of(centre_node, member("m"), number=2))
        assert links.peers() == {Peer("m", 2)}
    finally:
        mine.close()


@contextmanager
def files_left(count: int) -> Iterator[None]:
    """Let this process open only ``count`` more files inside (its soft ``ulimit -n``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # A new file takes the lowest free number, and the limit bounds the numbers: fill the
    # holes below the highest one in use, so that exactly ``count`` numbers are left above.
    top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    fillers = [os.open(os.devnull, os.O_RDONLY)]
    while fillers[-1] < top:
        fillers.append(os.open(os.devnull, os.O_RDONLY))
    resource.setrlimit(resource.RLIMIT_NOFILE, (fillers[-1] + 1 + count, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in fillers:
            os.close(fd)


def test_a_centre_out_of_files_rests_its_listener_and_takes_the_member_left_waiting_later(
    centre: tuple[Links, Heard],
) -> None:
    """Out of files, ``accept`` fails and leaves the connection queued, which keeps the
    listener readable: a watch that selected it again would spin a core."""
    links, _ = centre
    members = [socket.socket() for _ in range(3)]  # made first: connecting opens no file
    try:
        with files_left(2):
            for name, sock in zip(("m0", "m1", "m2"), members, strict=True):
                sock.connect(("127.0.0.1", links.port))
                hello = {"run": "job", "round": 1, "from": name, "to": "centre"}
                sock.sendall(json.dumps(hello).encode() + b"\n")
            wait_for(lambda: links.waiting_for_files, "the listener resting")
            assert links.peers() == {Peer("m0", 1), Peer("m1", 1)}
            members[0].close()  # its link ends in order, and frees a file
            wait_for(lambda: Peer("m2", 1) in links.peers(), "the member left waiting linked")
    finally:
        for sock in members:
            sock.close()


def test_the_centre_of_a_round_raises_its_open_files_limit_for_a_link_from_every_member(
    centre: tuple[Links, Heard],
) -> None:
    links, _ = centre
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    others = [member(f"m{i}") for i in range(500)]
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        links.hold(round_of(NodeInfo("centre", "127.0.0.1", 1, "", links.port), *others))
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 500 + len(
            os.listdir("/proc/self/fd")
        )
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


SHORT_CENTRE = """\
import logging, os, resource
from hpc_elastic.agent.links import Links
from hpc_elastic.rendezvous.api import NodeInfo, Round
logging.basicConfig(format="%(levelname)s %(message)s")
files = len(os.listdir("/proc/self/fd")) + 16
resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
links = Links.open({})
links.start("centre", "job", print)
members = [NodeInfo("centre", "127.0.0.1", 1, "", links.port)]
members += [NodeInfo(f"m{i}", "127.0.0.1", 1) for i in range(2000)]
links.hold(Round(1, tuple(members), "127.0.0.1", 1, 0, 0))
links.close()
"""


def test_a_centre_that_may_not_open_files_enough_says_how_to_raise_the_limit() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", SHORT_CENTRE], env=env, capture_output=True, text=True, check=True
    )
    assert "WARNING node centre is the centre of round 1, whose 2000 other members" in done.stderr
    assert "raise the limit ('ulimit -n " in done.stderr
