"""The round's TCPStore is the agent's: open before any worker knocks, for any script.

A plain torchrun script (no hpc_elastic import, ``init_process_group`` at module level) is
restarted after a worker's SIGKILL and must get its process group without a refused connect:
torch's TCPStore client answers one with a backoff of seconds. What is asserted is order, never
time: the store already listened when the script's first line ran (rank 0's too, which would
otherwise open it itself), and the agents saw every rank connect after they started it.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from cluster import wait_until
from lifeline import while_parent_lives
from test_agent import Cluster

from hpc_elastic import events
from hpc_elastic.agent import agent as agent_module
from hpc_elastic.agent import sockets, workers
from hpc_elastic.agent.agent import make_store_host
from hpc_elastic.agent.api import AgentSpec, ExitCode
from hpc_elastic.agent.storehost import (
    FILES_CAP,
    StoreHost,
    store_host_command,
    wants_store_host,
)
from hpc_elastic.agent.workers import launch
from hpc_elastic.contract import FILES_SPARE
from hpc_elastic.events import Kind
from hpc_elastic.rendezvous.handler import free_port

PLAIN = """\
import json, os, socket, sys, time
first = {"pid": os.getpid(), "rank": os.environ["RANK"], "round": os.environ["HPC_ELASTIC_ROUND"],
         "warm": "torch" in sys.modules,
         "agent_store": os.environ["TORCHELASTIC_USE_AGENT_STORE"]}
# The script's first connect attempt, as torch's TCPStore client is about to make it.
try:
    socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), 5).close()
    first["knock"] = "listening"
except OSError:
    first["knock"] = "refused"
out = sys.argv[1]
with open(os.path.join(out, "marks"), "a") as marks:
    marks.write(json.dumps({**first, "what": "started"}) + "\\n")

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
with open(os.path.join(out, "marks"), "a") as marks:
    marks.write(json.dumps({**first, "what": "grouped"}) + "\\n")
# The ranks stop together: each one's look at ``finish`` goes into the all_reduce, so none
# leaves the loop for the barrier while another makes one more all_reduce (gloo then waits on
# both until its timeout: a rank that saw the file a moment before the other once hung here).
while True:
    stop = torch.tensor([float(os.path.exists(os.path.join(out, "finish")))])
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    if stop.item():
        break
    time.sleep(0.1)
dist.barrier()
"""
"""A plain torchrun script: nothing of hpc_elastic; it writes what it saw at its first line
(whether MASTER_PORT already listened, whether torch was imported: a standby ran it) and once
its group is up, and trains until ``finish`` exists."""


def marks(out: Path) -> list[dict[str, object]]:
    path = out / "marks"
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # being written: a later look finds it whole
    return found


def grouped(out: Path, round_number: int) -> list[dict[str, object]]:
    return [m for m in marks(out) if m["what"] == "grouped" and m["round"] == str(round_number)]


def warm(cluster: Cluster) -> bool:
    """Every agent's standbys are back (full, imported) and its store host is ready."""
    return all(
        agent._standbys is not None
        and agent._standbys.full
        and agent._standbys.warm
        and agent._store_host is not None
        and agent._store_host.ready
        for agent in cluster.agents
    )


@pytest.mark.timeout(600)
def test_a_plain_script_restarted_after_a_worker_kill_finds_its_store_listening(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No heartbeat from this script, and no way to the standbys' refill but its connection.
    monkeypatch.setattr(agent_module, "REFILL_AFTER", 3600.0)
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    cluster = Cluster(tmp_path, nodes="2", nproc_per_node=1, prewarm=("torch",))
    command = (sys.executable, "-u", str(script), str(cluster.out))
    cluster.spec = replace(cluster.spec, command=command)
    cluster.start(2)
    try:
        assert wait_until(lambda: len(grouped(cluster.out, 1)) == 2, 300), marks(cluster.out)
        # The standbys are refilled once the ranks are connected (no heartbeat from this
        # script), and the next restart is warm: that is the restart under test.
        assert wait_until(lambda: warm(cluster), 300)
        victim = int(str(grouped(cluster.out, 1)[0]["pid"]))
        os.kill(victim, signal.SIGKILL)
        assert wait_until(lambda: len(grouped(cluster.out, 2)) == 2, 300), marks(cluster.out)
    finally:
        (cluster.out / "finish").touch()
    assert cluster.join(300) == {0: ExitCode.SUCCESS, 1: ExitCode.SUCCESS}

    started = [m for m in marks(cluster.out) if m["what"] == "started" and m["round"] == "2"]
    assert sorted(str(m["rank"]) for m in started) == ["0", "1"]
    for mark in started:
        assert mark["warm"] is True, mark  # a standby took the rank: the restart under test
        # Rank 0 too: its store was not its own to open, the agent's listened already.
        assert mark["knock"] == "listening", mark
    assert [m["agent_store"] for m in started if m["rank"] == "0"] == ["True"]

    history = list(events.read(cluster.job_dir / "events.jsonl"))
    assert [e.round for e in history if e.kind == Kind.FAILURE] == [1]
    for slot in ("n0", "n1"):
        kinds = [e.kind for e in history if e.round == 2 and e.slot == slot]
        # Each agent saw its rank connect to the store, after it started it.
        assert Kind.STORE_CONNECTED in kinds, kinds
        assert kinds.index(Kind.START) < kinds.index(Kind.STORE_CONNECTED)


def test_the_agent_publishes_a_free_port_when_its_store_host_is_not_ready(
    tmp_path: Path,
) -> None:
    """Still importing (or dead): the round's rank 0 opens its store itself, as before."""
    mute = tmp_path / "mute.py"
    mute.write_text("import sys\nsys.stdin.read()\n")  # never says it is ready
    host = StoreHost(
        [sys.executable, str(mute)],
        dict(os.environ),
        functools.partial(launch, stdin=subprocess.PIPE, stdout=subprocess.PIPE),
    )
    host.start()
    try:
        assert not host.ready
        assert host.open("127.0.0.1", free_port) is None
    finally:
        host.close()
    assert not host.alive


def test_a_store_host_that_stops_answering_is_given_up_within_its_wait(tmp_path: Path) -> None:
    """Ready, then silent: the rendezvous must not wait on it; the host is killed so that a
    late answer is never read as the next one's."""
    silent = tmp_path / "silent.py"
    silent.write_text(
        "import json, sys, time\nprint(json.dumps({'ready': 1}), flush=True)\n"
        "sys.stdin.readline()\n" + while_parent_lives("time.sleep(0.1)")
    )
    host = StoreHost(
        [sys.executable, str(silent)],
        dict(os.environ),
        functools.partial(launch, stdin=subprocess.PIPE, stdout=subprocess.PIPE),
    )
    host.start()
    try:
        assert wait_until(lambda: host.ready, 60)
        assert host.open("127.0.0.1", free_port) is None
        assert wait_until(lambda: not host.alive, 60)
    finally:
        host.close()


def real_store_host(tmp_path: Path) -> StoreHost:
    """A started store host of this interpreter (torch imported), launched as the agent's."""
    host = StoreHost(
        store_host_command(sys.executable, tmp_path / "host.log"),
        dict(os.environ),
        functools.partial(launch, stdin=subprocess.PIPE, stdout=subprocess.PIPE),
    )
    host.start()
    return host


@pytest.mark.timeout(300)
def test_a_store_host_opens_a_store_per_round_and_closes_what_is_not_kept(tmp_path: Path) -> None:
    host = real_store_host(tmp_path)
    try:
        assert wait_until(lambda: host.ready, 240)
        first = host.open("127.0.0.1", free_port)
        second = host.open("127.0.0.1", free_port)
        assert first is not None
        assert second is not None
        assert host.hosts(first)
        assert host.hosts(second)
        socket.create_connection(("127.0.0.1", first), 5).close()  # listening already
        host.keep([second])
        assert not host.hosts(first)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", first), 5).close()
        socket.create_connection(("127.0.0.1", second), 5).close()
    finally:
        host.close()
    assert not host.alive


def test_only_a_torch_prewarming_node_keeps_a_store_host(tmp_path: Path) -> None:
    python = (sys.executable, "-u", "train.py")
    assert wants_store_host(python, ("torch",))
    assert wants_store_host(python, ("torch._dynamo", "numpy"))
    assert not wants_store_host(python, ("json",))
    assert not wants_store_host(("bash", "train.sh"), ("torch",))
    spec = AgentSpec(job_dir=tmp_path, command=python, prewarm=("json",))
    assert make_store_host(spec, dict(os.environ), tmp_path) is None


TCP_TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:9C40 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 111 1
   1: 0100007F:D2F0 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000        0 222 1
   2: 0100007F:D2F2 0100007F:9C41 01 00000000:00000000 00:00000000 00000000  1000        0 333 1
   3: 0100007F:D2F4 0100007F:9C40 06 00000000:00000000 00:00000000 00000000  1000        0 444 1
"""
"""/proc/net/tcp: a listener on 40000, a connection to it (inode 222), one to 40001 (333) and
one to 40000 in TIME_WAIT (444)."""


def test_a_connection_counts_only_when_established_to_the_port_and_held_by_the_process() -> None:
    assert sockets.established_to(TCP_TABLE, {"222"}, 40000)
    assert not sockets.established_to(TCP_TABLE, {"333"}, 40000)  # another port
    assert not sockets.established_to(TCP_TABLE, {"111"}, 40000)  # the listener itself
    assert not sockets.established_to(TCP_TABLE, {"444"}, 40000)  # closing
    assert not sockets.established_to(TCP_TABLE, {"999"}, 40000)  # another process's


def test_the_agent_sees_a_process_connect_to_a_port_in_proc() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        watch = sockets.StoreWatch(port, until=time.monotonic() + 60)
        assert sockets.connected_to(os.getpid(), port) is False
        assert not watch.look([os.getpid()], time.monotonic())
        with socket.create_connection(("127.0.0.1", port), 5):
            assert sockets.connected_to(os.getpid(), port) is True
            assert watch.look([os.getpid()], time.monotonic())
            assert not watch.look([os.getpid()], time.monotonic())  # said once
    assert sockets.connected_to(2**22 + 12345, port) is None  # no such process


@pytest.mark.timeout(300)
def test_a_store_host_raises_its_open_files_limit_for_a_connection_from_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started, through the workers' trampoline, with a limit of 256 files (a TCPStore server
    held to 128 took 113 of 200 clients and reset the others)."""
    monkeypatch.setattr(workers, "USER_FILES", 256)
    host = real_store_host(tmp_path)
    try:
        assert wait_until(lambda: host.ready, 240)
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        files = FILES_CAP if hard == resource.RLIM_INFINITY else hard
        assert host.short_of_files(files - FILES_SPARE) is None
        short = host.short_of_files(files + 1)
        assert short is not None
        assert f"may open only {files} files, but each of the round's {files + 1} ranks" in short
        assert f"'ulimit -n {files + 1 + FILES_SPARE}'" in short
    finally:
        host.close()
