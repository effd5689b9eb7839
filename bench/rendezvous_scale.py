"""Rendezvous at scale: N simulated agents over P driver processes against a real ZooKeeper.

Each agent is the real ``StoreRendezvous`` on a real ``ZooKeeperStore``; a driver process
runs its share of the agents, one thread each in ``next_round`` (or, with ``--workers W``,
stepped by their step functions on W threads: ``Stepper``), over sessions of its own (one
per agent, or one per 16 agents where N sessions do not fit the machine: ``--share``). The
drivers are the 16-process harness of ``bench/rendezvous_bench.py`` grown into a scenario.
Per N and per server kind (one standalone server, a 3-server ensemble on loopback ports):

  * round 1, a join storm: every agent joins at once and calls ``next_round``;
  * then ``--rounds`` restarts (5): one agent reports a worker failure, and every agent, once
    its round is superseded (``changed``), calls ``next_round`` again, as after a failure.
    The round time of the table (median, p99) is theirs: a job pays it at every restart.
    With ``--warm-up W``, W restarts run before them and are left out of the table: a server's
    JVM compiles its hot paths in its first minute or more of load (its JIT compiler threads
    took half of the servers' CPU or more in the restarts right after a storm), which an
    ensemble that has served jobs for a while has long done;
  * a kill: the driver that holds 1 % of the agents is SIGKILLed; the others notice once
    the victims' sessions expire, and form the next round without them (detect: the first
    and the last survivor to see the loss; sessions ended: when the servers let the last
    victim go, as their logs say; re-form);
  * on the ensemble, a leader kill: the leader is SIGKILLed in the middle of a restart round;
  * a mass departure: the drivers that hold half of the agents left are SIGKILLed at once,
    and the others form the next round without them;
  * the job's end: every agent left reports its workers' success at once and waits in the
    exit barrier until the job closes (time until the last agent is let out).

Per round: time from the trigger (the common start, the failure report, the kill) until the
last agent holds the new round; bytes, requests and watch events each agent's sessions read
and wrote (counted in the drivers' kazoo connections, divided by the agents sharing them;
reads also by the job's node they read, e.g. ``GetData:roster``, in the JSON's ``per_agent``);
ZooKeeper's CPU, and of it its JIT compiler threads', and the drivers' CPU (from /proc).
Every round is checked: every agent holds the same round, each rank once, ranks 0..N-1.

Usage::

    python bench/rendezvous_scale.py --quick                # N = 64 and 256, 3 rounds
    python bench/rendezvous_scale.py --sizes 4096 --servers 3 --json out.json
    python bench/rendezvous_scale.py --fit out.json more.json   # round time against N

Prints one Markdown row per (N, servers), and with ``--json`` writes every measured figure.
The script re-invokes itself as ``... driver <json>`` for each driver process.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hpc_elastic import contract  # noqa: E402
from hpc_elastic.ensemble import zoocfg  # noqa: E402
from hpc_elastic.rendezvous import state as st  # noqa: E402
from hpc_elastic.rendezvous import testing  # noqa: E402
from hpc_elastic.rendezvous.api import (  # noqa: E402
    Failure,
    NodeInfo,
    RendezvousSettings,
    Round,
)
from hpc_elastic.rendezvous.backend import ConnectionState  # noqa: E402
from hpc_elastic.rendezvous.handler import Step, StoreRendezvous  # noqa: E402
from hpc_elastic.rendezvous.zookeeper import (  # noqa: E402
    ZooKeeperAddress,
    ZooKeeperStore,
    open_client,
)
from hpc_elastic.spec import NodeRange  # noqa: E402

SESSION = 6.0
"""The agents' session timeout: the product's default, the one the targets are set for."""
LAST_CALL = 120.0
"""Long enough that a join storm never completes below N: every round here is meant to hold
all N agents (a shrink after the kill skips the last call, ``state.no_newcomer``)."""
SHARE_ABOVE = 1024
"""Above this N, agents share sessions 16 to 1 unless ``--share`` says otherwise."""
THREAD_STACK = 256 * 1024
"""Bytes of stack per agent thread: a thousand threads a driver must fit in memory."""
ZK_HEAP = "2g"
SERVER_OPTIONS = {"maxClientCnxns": "0"}
"""Unlimited connections per client address: every bench client is 127.0.0.1. The servers tick
as the product's ensemble does (``zoocfg.timing``), unless ``--tick`` says otherwise."""


# ------------------------------------------------------ counting a driver's ZooKeeper traffic


class Traffic:
    """What the kazoo connections of one driver process read and wrote, counted by wrapping
    four methods of kazoo's ``ConnectionHandler`` (bench-only: the product never does this).
    Pings are not requests of the rendezvous and are left out of the request counts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def add(self, key: str, amount: int = 1) -> None:
        with self._lock:
            self.counts[key] += amount

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.counts)

    def install(self) -> None:
        from kazoo.protocol import connection  # noqa: PLC0415 (the bench's own instrument)

        handler = connection.ConnectionHandler
        read, write = handler._read, handler._write
        submit, watch_event = handler._submit, handler._read_watch_event

        def counted_read(this: Any, length: int, timeout: float) -> bytes:
            data: bytes = read(this, length, timeout)
            self.add("bytes_in", len(data))
            return data

        def counted_write(this: Any, msg: bytes, timeout: float) -> None:
            self.add("bytes_out", len(msg))
            write(this, msg, timeout)

        def counted_submit(this: Any, request: Any, timeout: float, xid: Any = None) -> None:
            name = type(request).__name__
            if name != "Ping":
                self.add(f"op:{name}")
            if name in READS_BY_NODE:
                self.add(f"{name}:{job_node(request.path)}")
            submit(this, request, timeout, xid)

        def counted_watch(this: Any, buffer: bytes, offset: int) -> None:
            self.add("watch_events")
            watch_event(this, buffer, offset)

        handler._read = counted_read
        handler._write = counted_write
        handler._submit = counted_submit
        handler._read_watch_event = counted_watch


READS_BY_NODE = ("GetData", "GetChildren", "GetChildren2")
"""Requests also counted by the job's node they read (``job_node``)."""


def job_node(path: str) -> str:
    """The node of the job that ``path`` is in: ``/hpc-elastic/<run>/rounds/3/...`` is in
    ``rounds``, the job's own node is ``job``."""
    parts = path.strip("/").split("/")
    return parts[2] if len(parts) > 2 else "job"


# ------------------------------------------------------------------------- driver process


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


class Stamped(threading.Event):
    """An agent's ``changed`` event that notes when it was first set: when the handler saw its
    round superseded, before the agent's thread waits its turn for the interpreter among the
    hundreds of a driver (a real agent has a process of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.at: float | None = None

    def set(self) -> None:
        if self.at is None:
            self.at = time.time()
        super().set()

    def clear(self) -> None:
        self.at = None
        super().clear()


@dataclass
class Outcome:
    """What one agent did in one round."""

    noticed: float | None = None
    done: float | None = None
    number: int = 0
    rank: int = -1
    members: int = 0
    digest: str = ""
    """Which round it holds: its number, a hash of its members in rank order, its port."""
    held: Round | None = field(default=None, repr=False)
    """The round it holds, until its digest is made (``Driver._report``)."""
    error: str = ""


@dataclass
class Task:
    """One agent's part of one round: ``next_round``, or the exit barrier (``finish``)."""

    index: int
    outcome: Outcome
    finish: bool
    epoch: int
    started: bool = False
    generation: int = -1
    """The handler's ``generation`` when it last went to sleep."""
    alarm: int = 0
    """Which of its ``wake_at`` alarms is the live one (an earlier one is stale)."""


class Stepper:
    """Steps a driver's agents through their rounds on ``workers`` threads.

    A handler's blocking loops (``next_round``, ``report_success``) are its step functions
    (``round_step``, ``barrier_step``) run until a round or a verdict, sleeping between
    steps until a store notification moves its ``generation`` or the clock reaches the
    step's ``wake_at``; the simulation drives the same steps. This does that for all of a
    driver's agents: a step runs on one of a few threads, a sleeping agent is woken by its
    connection's notifications (subscribed after its handlers', so its ``generation`` has
    moved by then) or by an alarm. A thread an agent, as a real agent's loop runs, costs the
    harness more than the agents: a thousand threads a driver, woken at every round, spent
    the driver's CPU waking each other and starved the connections' threads of the
    interpreter (a real agent has a process of its own)."""

    def __init__(
        self, agents: list[StoreRendezvous], stores: list[ZooKeeperStore], workers: int
    ) -> None:
        self.agents = agents
        share = math.ceil(len(agents) / len(stores))
        self._of_store = {
            id(store): range(i * share, min((i + 1) * share, len(agents)))
            for i, store in enumerate(stores)
        }
        """The agents (indices) on each store (by ``id``), ``share`` a store in order."""
        self._lock = threading.Lock()
        self._ready: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._sleeping: dict[int, Task] = {}
        self._unchanged: dict[int, Task] = {}
        """Agents waiting for their round to be superseded (``changed``) before they start."""
        self._alarms: list[tuple[float, int, int]] = []
        """A heap of (``wake_at``, alarm, agent index)."""
        self._alarm_set = threading.Condition(self._lock)
        self._epoch = 0
        self._left = 0
        self._finished = threading.Event()
        self._done: Callable[[Task, Step], None] = lambda task, step: None
        for store in stores:
            woken = partial(self._notified, id(store))
            store.subscribe(woken, woken)
            store.subscribe_connection(partial(self._reconnected, id(store)))
        for _ in range(workers):
            threading.Thread(target=self._work, daemon=True).start()
        threading.Thread(target=self._ring, daemon=True).start()

    def run(
        self,
        tasks: list[Task],
        at: float,
        after_change: bool,
        timeout: float,
        done: Callable[[Task, Step], None],
    ) -> None:
        """Run ``tasks`` from ``at`` (or, ``after_change``, each once its round is
        superseded) until each is done or ``timeout`` passed; ``done`` records a result."""
        self._done = done
        with self._lock:
            self._epoch += 1
            self._sleeping.clear()
            self._unchanged.clear()
            self._alarms.clear()
            self._left = len(tasks)
            self._finished.clear()
            for task in tasks:
                task.epoch = self._epoch
        if not tasks:
            return
        until(at)
        for task in tasks:
            if after_change and not self.agents[task.index].changed.is_set():
                with self._lock:
                    self._unchanged[task.index] = task
                if not self.agents[task.index].changed.is_set():
                    continue
                with self._lock:
                    if self._unchanged.pop(task.index, None) is None:
                        continue  # a notification took it meanwhile
            self._ready.put(task)
        self._finished.wait(timeout)
        with self._lock:
            self._epoch += 1  # whatever is still asleep or queued is of a round that ended
            for task in self._unchanged.values():
                task.outcome.error = "never superseded"

    def _notified(self, store: int) -> None:
        """A notification of one connection: wake its agents whose decision may change."""
        with self._lock:
            for index in self._of_store.get(store, ()):
                agent = self.agents[index]
                task = self._sleeping.get(index)
                if task is not None and agent.generation != task.generation:
                    del self._sleeping[index]
                    self._ready.put(task)
                task = self._unchanged.get(index)
                if task is not None and agent.changed.is_set():
                    del self._unchanged[index]
                    self._ready.put(task)

    def _reconnected(self, store: int, _state: ConnectionState) -> None:
        """A connection's state changed: its handlers may have a new decision to make."""
        self._notified(store)

    def _ring(self) -> None:
        """Wake the agents whose ``wake_at`` came."""
        with self._lock:
            while True:
                now = time.monotonic()
                while self._alarms and self._alarms[0][0] <= now:
                    _, alarm, index = heapq.heappop(self._alarms)
                    task = self._sleeping.get(index)
                    if task is not None and task.alarm == alarm:
                        del self._sleeping[index]
                        self._ready.put(task)
                wait = self._alarms[0][0] - now if self._alarms else None
                self._alarm_set.wait(wait)

    def _work(self) -> None:
        while True:
            task = self._ready.get()
            if task is None:
                return
            if task.epoch == self._epoch:
                self._step(task)

    def _step(self, task: Task) -> None:
        """Step one agent until it is done or has to wait, as its own loop would."""
        agent = self.agents[task.index]
        try:
            if not task.started:
                task.started = True
                task.outcome.noticed = getattr(agent.changed, "at", None)
                if task.finish and agent.begin_barrier():
                    return self._end(task, Step(st.Barrier.DONE, done=True))
                if not task.finish:
                    agent.begin_round()
            while True:
                generation = agent.generation
                step = agent.barrier_step() if task.finish else agent.round_step()
                if step.round is not None or step.done is not None:
                    return self._end(task, step)
                if not step.again:
                    return self._sleep(task, generation, step.wake_at)
        except Exception as error:  # reported, never raised: one agent must not end the bench
            task.outcome.error = f"error: {type(error).__name__}: {error}"
            self._end(task, None)

    def _sleep(self, task: Task, generation: int, wake_at: float | None) -> None:
        with self._lock:
            if task.epoch != self._epoch:
                return
            if self.agents[task.index].generation != generation:
                self._ready.put(task)  # notified between the step's read and now
                return
            task.generation = generation
            self._sleeping[task.index] = task
            if wake_at is not None:
                task.alarm += 1
                heapq.heappush(self._alarms, (wake_at, task.alarm, task.index))
                if self._alarms[0][2] == task.index:
                    self._alarm_set.notify()

    def _end(self, task: Task, step: Step | None) -> None:
        if step is not None:
            self._done(task, step)
        with self._lock:
            if task.epoch != self._epoch:
                return
            self._left -= 1
            if self._left == 0:
                self._finished.set()


class Driver:
    """``job["agents"]`` agents (global indices from ``job["first"]``) over sessions of their
    own, ``job["share"]`` agents a session."""

    def __init__(self, job: dict[str, Any], traffic: Traffic) -> None:
        self.job = job
        self.traffic = traffic
        address = ZooKeeperAddress.parse(job["hosts"])
        settings = RendezvousSettings(
            run_id=job["run_id"],
            nodes=NodeRange(job["min"], job["max"]),
            last_call=LAST_CALL,
            session_timeout=job["session"],
            max_restarts=1000,
        )
        count, share = job["agents"], job["share"]
        self._share = share
        self.connection_states: Counter[str] = Counter()
        self._states_reported: Counter[str] = Counter()
        """``connection_states`` at the last report: each change is reported once."""
        self.stores: list[ZooKeeperStore] = []
        for _ in range(math.ceil(count / share)):
            client = open_client(address, None, job["session"], connect_timeout=120.0)
            store = ZooKeeperStore(client, address, job["run_id"], None)
            store.subscribe_connection(self._on_connection)
            self.stores.append(store)
        self.agents = [
            StoreRendezvous(
                settings,
                NodeInfo(f"agent-{job['first'] + i:05d}", "127.0.0.1", 1),
                self.stores[i // share],
                owns_store=False,
            )
            for i in range(count)
        ]
        for agent in self.agents:
            agent.changed = Stamped()
        self.stepper = Stepper(self.agents, self.stores, job["workers"]) if job["workers"] else None
        """None: a thread an agent, each in its own ``next_round``."""
        self._held: dict[int, Outcome] = {}
        """What each agent (by index) held after the last round it formed."""
        self._digests: dict[int, tuple[tuple[NodeInfo, ...], str]] = {}
        """Digests of the members tuples this round's agents hold, by ``id``: each tuple is
        kept here with its digest, so that no id is reused for another tuple meanwhile."""
        self._digesting = threading.Lock()

    def _on_connection(self, state: ConnectionState) -> None:
        self.connection_states[state.value] += 1

    def round(self, command: dict[str, Any]) -> dict[str, Any]:
        """Run one round: every agent waits for its round to be superseded (not in round 1),
        then calls ``next_round``; ``trigger``: this driver's first agent reports a failure at
        ``at``, which is what supersedes the round."""
        before = self.traffic.snapshot()
        self._digests.clear()
        outcomes = [Outcome() for _ in self.agents]
        if self.stepper is not None:
            self._stepped(command, outcomes)
        else:
            self._threaded(command, outcomes)
        traffic = self.traffic.snapshot()
        traffic.subtract(before)
        return self._report(command, outcomes, traffic)

    def _stepped(self, command: dict[str, Any], outcomes: list[Outcome]) -> None:
        assert self.stepper is not None
        finish = bool(command.get("finish"))
        tasks = [Task(index, outcome, finish, 0) for index, outcome in enumerate(outcomes)]
        if command.get("trigger"):
            threading.Thread(target=self._trigger, args=(command["at"],), daemon=True).start()
        self.stepper.run(
            tasks,
            command["at"],
            after_change=command["k"] > 1 and not finish,
            timeout=command["timeout"],
            done=self._ended,
        )

    def _ended(self, task: Task, step: Step) -> None:
        """Record what one stepped agent got: its round, or the exit barrier's verdict."""
        if step.round is not None:
            self._hold(task.index, task.outcome, step.round)
        elif step.done:
            self._held_again(task.index, task.outcome)
        else:
            task.outcome.error = "the exit barrier let it out without the job succeeding"

    def _trigger(self, at: float) -> None:
        until(at)
        self.agents[0].report_failure(
            Failure(self.agents[0].node.node_id, "127.0.0.1", 0, 1, None, "bench", time.time())
        )

    def _threaded(self, command: dict[str, Any], outcomes: list[Outcome]) -> None:
        one = self._finish if command.get("finish") else self._one
        threads = [
            threading.Thread(target=one, args=(index, outcome, command), daemon=True)
            for index, outcome in enumerate(outcomes)
        ]
        for thread in threads:
            thread.start()
        if command.get("trigger"):
            self._trigger(command["at"])
        deadline = time.monotonic() + command["timeout"]
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _one(self, index: int, outcome: Outcome, command: dict[str, Any]) -> None:
        agent = self.agents[index]
        try:
            if command["k"] == 1:
                until(command["at"])
            else:
                if not agent.changed.wait(command["timeout"]):
                    outcome.error = "never superseded"
                    return
                assert isinstance(agent.changed, Stamped)
                outcome.noticed = agent.changed.at
            self._hold(index, outcome, agent.next_round())
        except Exception as error:  # reported, never raised: one agent must not end the bench
            outcome.error = f"error: {type(error).__name__}: {error}"

    def _finish(self, index: int, outcome: Outcome, command: dict[str, Any]) -> None:
        """The job's end for one agent: its workers succeeded; it waits in the exit barrier
        until every member's did and the job closes. It reports the round it held."""
        try:
            until(command["at"])
            if not self.agents[index].report_success():
                outcome.error = "the exit barrier let it out without the job succeeding"
                return
            self._held_again(index, outcome)
        except Exception as error:  # reported, never raised: one agent must not end the bench
            outcome.error = f"error: {type(error).__name__}: {error}"

    def _hold(self, index: int, outcome: Outcome, got: Round) -> None:
        """Agent ``index`` holds round ``got`` now."""
        outcome.done = time.time()
        outcome.number = got.number
        outcome.rank = got.group_rank(self.agents[index].node.node_id)
        outcome.members = len(got.members)
        outcome.held = got  # digested in the report: not on the driver's CPU while others form
        self._held[index] = outcome

    def _held_again(self, index: int, outcome: Outcome) -> None:
        """Agent ``index`` was let out of the exit barrier, the job succeeded: it reports the
        round it held."""
        held = self._held[index]
        outcome.done = time.time()
        outcome.number, outcome.rank = held.number, held.rank
        outcome.members, outcome.digest = held.members, held.digest

    def _digest(self, got: Round) -> str:
        """The round's identity: the agents of one round sharing a connection hold the same
        decoded members tuple, so it is hashed once per tuple (with sha256: ``hash`` differs
        between processes). Made in the report, once every agent of the driver holds its
        round: made as each returned, the hashing (once per connection) took a tenth of four
        drivers' CPU in the restarts (py-spy) while the other agents still formed the round."""
        key = id(got.members)
        with self._digesting:
            if key not in self._digests:
                ids = ",".join(member.node_id for member in got.members).encode()
                digest = hashlib.sha256(ids).hexdigest()[:16]
                self._digests[key] = (got.members, f"{got.number}:{digest}:{got.master_port}")
            return self._digests[key][1]

    def _sentinels_noticed(self, outcomes: list[Outcome]) -> list[float]:
        """When the agents on a sentinel's connection noticed: the first to hear a loss."""
        return sorted(
            outcome.noticed
            for i, outcome in enumerate(outcomes)
            if outcome.noticed is not None and self.stores[i // self._share].sentinel
        )

    def _report(
        self, command: dict[str, Any], outcomes: list[Outcome], traffic: Counter[str]
    ) -> dict[str, Any]:
        for outcome in outcomes:
            if outcome.held is not None:
                outcome.digest, outcome.held = self._digest(outcome.held), None
        done = [o.done for o in outcomes if o.done is not None]
        noticed = [o.noticed for o in outcomes if o.noticed is not None]
        problems = Counter(o.error for o in outcomes if o.error)
        states = Counter(self.connection_states)
        since_last, self._states_reported = states - self._states_reported, states
        return {
            "k": command["k"],
            "returned": len(done),
            "agents": len(outcomes),
            "first_done": min(done, default=None),
            "last_done": max(done, default=None),
            "first_noticed": min(noticed, default=None),
            "last_noticed": max(noticed, default=None),
            "noticed": sorted(noticed),
            "sentinels_noticed": self._sentinels_noticed(outcomes),
            "numbers": sorted({o.number for o in outcomes if o.done is not None}),
            "ranks": [o.rank for o in outcomes if o.done is not None],
            "sizes": sorted({o.members for o in outcomes if o.done is not None}),
            "digests": sorted({o.digest for o in outcomes if o.digest}),
            "problems": dict(problems),
            "traffic": dict(traffic),
            "connection_states": dict(since_last),
            "state_bytes": len(self.stores[0].get_state()[0] or b""),
            "children_bytes": sum(4 + len(node) for node in self.stores[0].alive()),
        }


def until(t0: float) -> None:
    time.sleep(max(0.0, t0 - time.time()))


def driver_main(job: dict[str, Any]) -> None:
    threading.stack_size(THREAD_STACK)
    traffic = Traffic()
    traffic.install()
    driver = Driver(job, traffic)
    say(ready=True, sessions=len(driver.stores))
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "round":
            say(**driver.round(command))
        elif command["do"] == "stop":
            break
    for agent in driver.agents:
        agent.leave()
    for store in driver.stores:
        store.release()


# ------------------------------------------------------------------------------ orchestration


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


JIT_THREADS = ("C1 CompilerThre", "C2 CompilerThre")
"""How the JVM (HotSpot) names its JIT compiler threads in ``/proc/<pid>/task/*/stat``, cut to
the 15 characters Linux keeps."""


def jit_ticks(pid: int) -> dict[int, int]:
    """CPU ticks so far of each JIT compiler thread of JVM ``pid``, by thread id."""
    ticks = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return {}
    for task in tasks:
        try:
            text = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        name, _, rest = text[text.index("(") + 1 :].rpartition(")")
        if name.startswith(JIT_THREADS):
            fields = rest.split()
            ticks[int(task.name)] = int(fields[11]) + int(fields[12])
    return ticks


def jit_seconds(before: dict[int, int], after: dict[int, int]) -> float:
    """CPU the JIT compiler threads spent between two ``jit_ticks`` readings. HotSpot starts
    and ends compiler threads as the work comes and goes, and a thread that ended between the
    readings takes its last ticks with it, so this is at least what they spent."""
    spent = sum(ticks - before.get(tid, 0) for tid, ticks in after.items())
    return spent / os.sysconf("SC_CLK_TCK")


@dataclass
class ServersCPU:
    """The CPU the servers ``pids`` spent since this was made, and of it their JIT's."""

    pids: list[int]
    cpu: list[float] = field(init=False)
    jit: list[dict[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.cpu = [cpu_seconds(pid) for pid in self.pids]
        self.jit = [jit_ticks(pid) for pid in self.pids]

    def spent(self) -> tuple[float, float]:
        """``(all, the JIT's)`` seconds of CPU since this was made."""
        compiling = sum(
            jit_seconds(before, jit_ticks(pid))
            for pid, before in zip(self.pids, self.jit, strict=True)
        )
        return sum(self.each()), compiling

    def each(self) -> list[float]:
        """The seconds of CPU each server spent since this was made, in the order of ``pids``."""
        return [cpu_seconds(pid) - cpu for pid, cpu in zip(self.pids, self.cpu, strict=True)]


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class DriverProcess:
    process: subprocess.Popen[str]
    agents: int
    sessions: int = 0
    lines: list[dict[str, Any]] = field(default_factory=list)
    reader: threading.Thread | None = None

    def read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                self.lines.append(json.loads(line))

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def wait_lines(self, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while len(self.lines) < count:
            if time.monotonic() > deadline or self.process.poll() is not None:
                return len(self.lines) >= count
            time.sleep(0.02)
        return True


@dataclass
class Plan:
    """One measurement: N agents, sessions shared ``share`` to 1, over ``processes`` drivers."""

    n: int
    servers: int
    processes: int
    share: int
    rounds: int
    session: float
    timeout: float
    workers: int = 0
    """Threads a driver steps its agents on (``Stepper``); 0: a thread an agent."""
    warm_up: int = 0
    """Restart rounds after the storm and before the measured ones, left out of the table: a
    server fresh from its start spends most of its CPU compiling its hot paths (the JVM's JIT)
    for the first minute or more of load, which an ensemble that has served jobs for hours has
    long done."""

    @property
    def victims(self) -> int:
        """1 % of the agents (at least one session's worth), all in the last driver."""
        wanted = max(1, round(self.n / 100))
        return math.ceil(wanted / self.share) * self.share

    def slices(self) -> list[int]:
        """Agents per driver: the others spread evenly (whole sessions), the victims last."""
        rest = self.n - self.victims
        sessions = math.ceil(rest / self.share)
        drivers = max(1, min(self.processes - 1, sessions))
        per, extra = divmod(sessions, drivers)
        counts = [(per + (i < extra)) * self.share for i in range(drivers)]
        counts[-1] -= sum(counts) - rest
        return [*counts, self.victims]

    @property
    def departing(self) -> int:
        """How many drivers leave at once in the mass departure: the last ones before the
        victims', until they hold half of the agents left after the kill (0: one driver)."""
        others = self.slices()[:-1]
        leaving = 0
        while leaving < len(others) - 1 and 2 * sum(others[len(others) - leaving :]) < sum(others):
            leaving += 1
        return leaving

    @property
    def floor(self) -> int:
        """The job's minimum: the agents left after both kills, so that every round here
        holds all the agents alive (a shrink skips the last call)."""
        others = self.slices()[:-1]
        return sum(others[: len(others) - self.departing])


@contextmanager
def zookeeper(
    servers: int, scratch: Path, tick_ms: int = contract.ZK_TICK_MS, heap: str = ZK_HEAP
) -> Iterator[list[testing.ZooKeeperServer]]:
    options = {**SERVER_OPTIONS, **zoocfg.timing(tick_ms)}
    if servers == 1:
        made = [testing.ZooKeeperServer(scratch / "zk", heap=heap, options=options)]
    else:
        made = testing.ensemble(scratch, servers, heap=heap, options=options)
    for server in made:
        server.start(wait=0)
    try:
        for server in made:
            server.wait_ready(120)
        yield made
    finally:
        for server in made:
            server.stop(signal.SIGKILL)


class Bench:
    """One plan against one ZooKeeper (standalone or ensemble): every round and scenario."""

    def __init__(self, plan: Plan, servers: list[testing.ZooKeeperServer]) -> None:
        self.plan = plan
        self.servers = servers
        self.drivers: list[DriverProcess] = []
        self.rows: list[dict[str, Any]] = []

    def start_drivers(self) -> None:
        hosts = ",".join(server.hosts for server in self.servers)
        first = 0
        run_id = f"scale-{self.plan.n}-{self.plan.servers}"
        for count in self.plan.slices():
            job = {
                "hosts": hosts,
                "run_id": run_id,
                "first": first,
                "agents": count,
                "share": self.plan.share,
                "min": self.plan.floor,
                "max": self.plan.n,
                "session": self.plan.session,
                "workers": self.plan.workers,
            }
            first += count
            process = subprocess.Popen(
                [sys.executable, __file__, "driver", json.dumps(job)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            driver = DriverProcess(process, count)
            driver.reader = threading.Thread(target=driver.read, daemon=True)
            driver.reader.start()
            self.drivers.append(driver)
        for driver in self.drivers:
            if not driver.wait_lines(1, 600):
                raise RuntimeError(f"a driver of {driver.agents} agents did not start")
            driver.sessions = driver.lines[0]["sessions"]

    def stop(self) -> None:
        for driver in self.drivers:
            if driver.process.poll() is None:
                driver.process.kill()
            driver.process.wait()

    def round(
        self,
        k: int,
        kind: str,
        drivers: list[DriverProcess],
        act: Callable[[float], None] | None = None,
        *,
        trigger: bool = True,
        finish: bool = False,
    ) -> dict[str, Any]:
        """Send round ``k`` to ``drivers``; ``act(at)`` runs at the round's start (a kill);
        ``finish``: every agent reports success instead of forming a round (the job's end)."""
        at = time.time() + 0.5
        pids = [server.process.pid for server in self.servers if server.process]
        zk_cpu = ServersCPU(pids)
        agents_cpu = sum(cpu_seconds(d.process.pid) for d in drivers)
        counts = {id(driver): len(driver.lines) + 1 for driver in drivers}
        for index, driver in enumerate(drivers):
            first = trigger and index == 0
            driver.send(
                do="round", k=k, at=at, trigger=first, finish=finish, timeout=self.plan.timeout
            )
        if act is not None:
            until(at)
            act(at)
        for driver in drivers:
            driver.wait_lines(counts[id(driver)], self.plan.timeout + 60)
        reports = [d.lines[-1] for d in drivers if len(d.lines) >= counts[id(d)]]
        row = summarize(k, kind, at, reports, drivers=len(drivers), plan=self.plan)
        row["zk_cpu_s"], row["zk_jit_s"] = zk_cpu.spent()
        row["agents_cpu_s"] = sum(cpu_seconds(d.process.pid) for d in drivers) - agents_cpu
        row["zk_rss_mb"] = sum(rss_bytes(pid) for pid in pids) / 2**20
        row["agents_rss_mb"] = sum(rss_bytes(d.process.pid) for d in drivers) / 2**20
        ended = sessions_ended(self.servers, at)
        row["sessions_ended_s"] = (max(ended) - at) if ended else None
        self.rows.append(row)
        print(json.dumps(compact(row)), flush=True)
        return row

    def run(self) -> None:
        self.start_drivers()
        every = self.drivers
        kinds = ["join storm"] + ["warm-up"] * self.plan.warm_up + ["restart"] * self.plan.rounds
        for k, kind in enumerate(kinds, start=1):
            row = self.round(k, kind, every, trigger=k > 1)
            if not row["ok"]:
                return
        victims, survivors = self.drivers[-1], self.drivers[:-1]
        k = len(kinds) + 1
        row = self.round(
            k, "1% killed", survivors, act=lambda _: victims.process.kill(), trigger=False
        )
        if not row["ok"]:
            return
        if len(self.servers) > 1:
            k += 1
            if not self.kill_leader(k, survivors):
                return
        staying = self.mass_departure(k + 1, survivors)
        if staying is not None:
            self.round(k + 2, "job end", staying, trigger=False, finish=True)

    def kill_leader(self, k: int, drivers: list[DriverProcess]) -> bool:
        """Round ``k`` with the leader SIGKILLed halfway through a restart; whether it formed."""
        leader = next((s for s in self.servers if testing.mode(s.port) == "leader"), None)
        if leader is None:
            print("no leader found; the leader kill is skipped", flush=True)
            return True
        restarts = [r["round_s"] for r in self.rows if r["kind"] == "restart" and r["ok"]]
        delay = statistics.median(restarts) / 2 if restarts else 0.1

        def kill(at: float) -> None:
            until(at + delay)
            assert leader.process is not None
            leader.process.kill()

        row = self.round(k, "leader killed", drivers, act=kill)
        row["leader_killed_after_s"] = delay
        return bool(row["ok"])

    def mass_departure(self, k: int, drivers: list[DriverProcess]) -> list[DriverProcess] | None:
        """Round ``k``: the last ``plan.departing`` of ``drivers`` are SIGKILLed at once; the
        drivers left, if they formed the round."""
        leaving = self.plan.departing
        if not leaving:
            print("one driver only: the mass departure is skipped", flush=True)
            return drivers
        gone, staying = drivers[-leaving:], drivers[:-leaving]

        def kill(_: float) -> None:
            for driver in gone:
                driver.process.kill()

        row = self.round(k, "half lost", staying, act=kill, trigger=False)
        return staying if row["ok"] else None


def server_log(server: testing.ZooKeeperServer) -> Path:
    """Where ``testing.ZooKeeperServer`` writes the server's log."""
    return server.data_dir / "zk.out"


EXPIRED = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) .*Expiring session 0x[0-9a-f]+, timeout of")
"""A line of a server's log (``zk.out``, timestamped by ``testing.LOGGER_FLAGS``) that ends a
session whose client fell silent: the moment the servers let a lost agent go."""


def sessions_ended(servers: list[testing.ZooKeeperServer], since: float) -> list[float]:
    """When the servers ended silent sessions (epoch seconds), from ``since`` on, as their
    logs say: splits a loss round into ZooKeeper's wait for the session and the survivors'
    work after it. Empty where the servers log nothing (no slf4j binding installed)."""
    midnight = datetime.fromtimestamp(since).replace(hour=0, minute=0, second=0, microsecond=0)
    ended = []
    for server in servers:
        log = server_log(server)
        text = log.read_text(errors="replace") if log.exists() else ""
        for match in filter(None, map(EXPIRED.match, text.splitlines())):
            hours, minutes, seconds, millis = map(int, match.groups())
            at = midnight.timestamp() + hours * 3600 + minutes * 60 + seconds + millis / 1000
            if at < since - 12 * 3600:
                at += 24 * 3600  # logged after midnight
            if at >= since:
                ended.append(at)
    return ended


def _quantiles(values: list[float]) -> dict[str, float]:
    """The 10th, 50th and 90th percentile and the last of sorted ``values``; none if empty."""
    if not values:
        return {}
    at = {f"p{p}": values[min(len(values) - 1, len(values) * p // 100)] for p in (10, 50, 90)}
    return {name: round(value, 3) for name, value in {**at, "max": values[-1]}.items()}


def summarize(
    k: int, kind: str, at: float, reports: list[dict[str, Any]], *, drivers: int, plan: Plan
) -> dict[str, Any]:
    """One round's figures from its drivers' reports, and whether its invariants held."""
    agents = sum(r["agents"] for r in reports)
    returned = sum(r["returned"] for r in reports)
    ranks = sorted(rank for r in reports for rank in r["ranks"])
    digests = {d for r in reports for d in r["digests"]}
    numbers = {n for r in reports for n in r["numbers"]}
    traffic: Counter[str] = Counter()
    states: Counter[str] = Counter()
    problems: Counter[str] = Counter()
    for report in reports:
        traffic.update(report["traffic"])
        states.update(report["connection_states"])
        problems.update(report["problems"])
    last = max((r["last_done"] for r in reports if r["last_done"]), default=None)
    noticed = max((r["last_noticed"] for r in reports if r["last_noticed"]), default=None)
    first = min((r["first_noticed"] for r in reports if r["first_noticed"]), default=None)
    every = sorted(when - at for r in reports for when in r["noticed"])
    on_sentinels = sorted(when - at for r in reports for when in r["sentinels_noticed"])
    ok = (
        len(reports) == drivers
        and returned == agents
        and ranks == list(range(agents))
        and len(digests) == 1
        and len(numbers) == 1
    )
    return {
        "k": k,
        "kind": kind,
        "n": plan.n,
        "servers": plan.servers,
        "share": plan.share,
        "agents": agents,
        "returned": returned,
        "ok": ok,
        "round_s": (last - at) if last and ok else None,
        "noticed_s": (noticed - at) if noticed else None,
        "first_noticed_s": (first - at) if first else None,
        "noticed_quantiles_s": _quantiles(every),
        "sentinels_noticed_s": _quantiles(on_sentinels),
        "numbers": sorted(numbers),
        "problems": dict(problems),
        "per_agent": {key: value / max(agents, 1) for key, value in sorted(traffic.items())},
        "state_bytes": max((r["state_bytes"] for r in reports), default=0),
        "children_bytes": max((r["children_bytes"] for r in reports), default=0),
        "connection_states": dict(states),
    }


def compact(row: dict[str, Any]) -> dict[str, Any]:
    """A row with its figures rounded, for the progress lines."""
    shown = {k: v for k, v in row.items() if k != "per_agent"}
    shown["per_agent"] = {k: round(v, 1) for k, v in row["per_agent"].items()}
    for key, value in shown.items():
        if isinstance(value, float):
            shown[key] = round(value, 3)
    return shown


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile by the nearest rank: with 5 values, p99 is the largest."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def table_row(plan: Plan, rows: list[dict[str, Any]]) -> str:
    """One Markdown row; the cost columns average the restart rounds that completed only."""
    rounds = [r for r in rows if r["kind"] == "restart" and r["ok"]]
    times = [r["round_s"] for r in rounds]
    failed = plan.rounds - len(times)

    def figure(kind: str) -> str:
        found = [r for r in rows if r["kind"] == kind]
        if not found:
            return "-"
        row = found[0]
        if row["round_s"] is None:
            return f"no round ({row['returned']} of {row['agents']} returned)"
        if kind == "job end":
            return f"{row['round_s']:.2f} s ({row['agents']} agents)"
        noticed = ""
        if kind != "leader killed":
            noticed = f"detect {row['first_noticed_s']:.2f}-{row['noticed_s']:.2f} s, "
        if row.get("sessions_ended_s") is not None:
            noticed += f"sessions ended {row['sessions_ended_s']:.2f} s, "
        return f"{noticed}re-form {row['round_s']:.2f} s"

    def mean(key: str) -> str:
        return f"{statistics.mean(r[key] for r in rounds):.2f} s" if rounds else "-"

    bytes_in = [r["per_agent"].get("bytes_in", 0.0) / 1024 for r in rounds]
    lost = sum(r["connection_states"].get("lost", 0) for r in rows)
    sessions = f"{plan.n // plan.share} (shared {plan.share}:1)" if plan.share > 1 else f"{plan.n}"
    servers = "standalone" if plan.servers == 1 else f"{plan.servers} servers"
    if plan.warm_up:
        servers += f", warmed by {plan.warm_up} restarts"
    median = f"{statistics.median(times):.2f} s" if times else "-"
    p99 = f"{percentile(times, 0.99):.2f} s" if times else "-"
    storm = rows[0] if rows else None
    if storm is None or not storm["ok"]:
        returned = f"{storm['returned']} of {storm['agents']} returned" if storm else "none started"
        join = f"none within {plan.timeout:g} s ({returned})"
    else:
        join = f"{storm['round_s']:.2f} s"
        if failed:
            p99 += f"; {failed} of {plan.rounds} not measured: one took over {plan.timeout:g} s"
    return (
        f"| {plan.n} | {servers} "
        f"| {sessions} | {len(plan.slices())} | {median} | {p99} | {join} "
        f"| {f'{statistics.median(bytes_in):.1f} KiB' if bytes_in else '-'} "
        f"| {mean('zk_cpu_s')} | {mean('zk_jit_s')} | {mean('agents_cpu_s')} "
        f"| {figure('1% killed')} | {figure('leader killed')} | {figure('half lost')} "
        f"| {figure('job end')} | {lost} |"
    )


HEADER = (
    "| agents | ZooKeeper | sessions | drivers | restart round, median | restart round, p99 "
    "| join storm | read per agent a restart (median) | ZooKeeper CPU a restart "
    "| of it, the JIT's | agents' CPU a restart "
    "| 1 % killed (session {session:g} s) | leader killed mid-round | half lost at once "
    "| job end (every agent left succeeds) | sessions lost |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def power_law(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(a, b)`` of the least-squares fit of ``t = a * n**b`` on a log-log scale."""
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return math.exp(my - b * mx), b


def fit(files: list[Path]) -> None:
    """Print, per ZooKeeper kind and round kind, the median time at each N and the power law
    through them, from the ``--json`` files of earlier runs."""
    rows = [row for file in files for row in json.loads(file.read_text())]
    groups: dict[tuple[int, str], dict[int, list[float]]] = {}
    for row in rows:
        if row["round_s"] is not None:
            key = (row["servers"], row["kind"])
            groups.setdefault(key, {}).setdefault(row["n"], []).append(row["round_s"])
    for (servers, kind), by_n in sorted(groups.items()):
        points = sorted((n, statistics.median(times)) for n, times in by_n.items())
        shown = ", ".join(f"N={n}: {t:.2f} s" for n, t in points)
        print(f"{servers} server(s), {kind}: {shown}")
        if len(points) >= 2:
            a, b = power_law(points)
            print(f"    fit: t = {a:.3g} * N^{b:.2f} s")


def keep_logs(servers: list[testing.ZooKeeperServer], into: Path, prefix: str) -> None:
    """Each server's log as ``<prefix>-zk<i>.out`` in ``into``: a round far slower than the
    others (a leader's election that took 40 s) is explained only by the servers' logs, which
    go with the bench's scratch directory."""
    into.mkdir(parents=True, exist_ok=True)
    for index, server in enumerate(servers, start=1):
        log = server_log(server)
        if log.exists():
            shutil.copyfile(log, into / f"{prefix}-zk{index}.out")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 64 and 256, 3 rounds, 4 drivers")
    parser.add_argument("--sizes", default="256,1024,4096,16384", help="comma-separated N")
    parser.add_argument("--servers", default="1,3", help="1 (standalone), 3 (ensemble) or both")
    parser.add_argument("--processes", type=int, default=16, help="driver processes")
    parser.add_argument(
        "--share", type=int, help=f"agents a session (default 16 above N={SHARE_ABOVE}, else 1)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="restart rounds after the storm")
    parser.add_argument(
        "--warm-up",
        type=int,
        default=0,
        help="restart rounds before the measured ones, left out of the table: the servers' JIT "
        "compiles their hot paths, as on an ensemble that has served for a while",
    )
    parser.add_argument("--session", type=float, default=SESSION, help="session timeout, s")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a round may take")
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="threads a driver steps its agents on (0: a thread an agent, in next_round)",
    )
    parser.add_argument(
        "--tick",
        type=int,
        default=contract.ZK_TICK_MS,
        help="the servers' tickTime, ms (default: the product ensemble's)",
    )
    parser.add_argument(
        "--heap",
        default=ZK_HEAP,
        help=f"each server's JVM heap (default {ZK_HEAP}; the product's ensemble: "
        f"{contract.DEFAULT_ZK_HEAP})",
    )
    parser.add_argument("--json", type=Path, help="write every round's figures here")
    parser.add_argument(
        "--logs", type=Path, help="keep the servers' logs here (N-servers-zkI.out), to see why"
    )
    parser.add_argument("--fit", type=Path, nargs="+", help="only fit the --json files given")
    args = parser.parse_args()
    if args.fit:
        fit(args.fit)
        return
    load = os.getloadavg()
    print(f"load average at the start: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}", flush=True)
    print(f"servers tick every {args.tick} ms, heap {args.heap}", flush=True)
    sizes = [64, 256] if args.quick else [int(n) for n in args.sizes.split(",")]
    processes = 4 if args.quick else args.processes
    rounds = 3 if args.quick else args.rounds
    timeout = min(args.timeout, 60.0) if args.quick else args.timeout
    table: list[str] = []
    everything: list[dict[str, Any]] = []
    for n in sizes:
        for servers in (int(s) for s in args.servers.split(",")):
            share = args.share or (16 if n > SHARE_ABOVE else 1)
            plan = Plan(
                n,
                servers,
                processes,
                share,
                rounds,
                args.session,
                timeout,
                args.workers,
                args.warm_up,
            )
            print(
                f"# N={n}, servers={servers}, share={share}, drivers={len(plan.slices())}",
                flush=True,
            )
            with (
                tempfile.TemporaryDirectory() as scratch,
                zookeeper(servers, Path(scratch), args.tick, args.heap) as zk,
            ):
                bench = Bench(plan, zk)
                try:
                    bench.run()
                finally:
                    bench.stop()
                    if args.logs:
                        keep_logs(zk, args.logs, f"{n}-{servers}")
            table.append(table_row(plan, bench.rows))
            everything.extend(bench.rows)
            if args.json:
                args.json.write_text(json.dumps(everything, indent=1))
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(HEADER.format(session=args.session))
    for row in table:
        print(row)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "driver":
        driver_main(json.loads(sys.argv[2]))
    else:
        main()
