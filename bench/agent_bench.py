"""Recovery time and idle cost of the node agent, side by side with torchrun.

4 agents x 1 worker on this machine, the same tiny gloo script (tests/workloads/train_gloo.py)
for both launchers, in the same run:

* worker SIGKILL -> first step completed by the restarted group;
* agent SIGKILL  -> first step completed at the smaller world size (``--nodes 3:4``);
* a 4th agent starts next to 3 that train (``--nodes 3:4``) -> first step at world size 4;
* a node freezes (SIGSTOP to its agent and workers: nothing closes, only its ZooKeeper session
  expires) -> first step at world size 3;
* hot spares: a member's agent SIGKILL (``--nodes 3:3``) -> first step at world size 3 again,
  with a 4th agent waiting beside the full round (``submit --spares 1``), and without one,
  where a new agent is started at the moment of the kill (the best a requeue can do: Slurm's
  own detection, requeue delay and queue wait come on top);
* idle agent CPU (%) and RSS (MB) over a few seconds of training.

Each scenario runs for torchrun, the agent with cold workers, the agent with ``--prewarm
torch`` (these two with a session of 2 s and a last call of 1 s) and the agent exactly as
``submit`` renders it (its default session timeout and last call, ``--prewarm torch``), one
after the other in the same run; the table has one row per scenario. For the
agent, each try also prints its restart timeline (``hpc_elastic.ops.phases``: seconds after the
round's end was first seen), so the table says how long and the timeline says where.

torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (with 2.13's default no restart
recovers at all) and the c10d rendezvous; an attempt that has not recovered within
``--give-up`` seconds counts as "did not recover". Usage::

    python bench/agent_bench.py --zk 127.0.0.1:2181 [--repeats 3] [--no-idle]

``--side-by-side`` runs the restart table in one command: the four scenarios (worker SIGKILL,
node SIGKILL, a new node, a frozen node; 4 agents x 1 worker) for torchrun, the agent with
cold workers, with ``--prewarm torch``, as ``submit`` renders it, and with ``--in-place
--prewarm torch`` (tests/workloads/train_inplace.py, which uses
``hpc_elastic.train.InPlace``). Every agent column needs a
ZooKeeper and gets the same one: ``--zk private`` starts one for the run (tickTime 500, as
the dev cluster's) and stops it at the end::

    python bench/agent_bench.py --side-by-side --zk private --repeats 2 --give-up 60

``--workload`` (repeatable) picks the training script, each one's rows beside the others':
``gloo`` is tests/workloads/train_gloo.py (ours: it beats the heartbeat and writes the
timeline's ready and first-step events); ``plain`` and ``plain-main`` are torchrun scripts that
import nothing of hpc_elastic, with ``init_process_group`` at module level or inside
``main()`` (tests/workloads/plain_module.py, plain_main.py); ``lightning`` is a Lightning
script whose ``DDPStrategy`` starts the group (plain_lightning.py; its standbys prewarm
``lightning.pytorch`` too; skipped when Lightning is not installed: ``pip install --no-deps
lightning lightning-utilities torchmetrics tqdm``, never another torch)::

    python bench/agent_bench.py --side-by-side --zk private --repeats 10 --give-up 60 \
        --workload gloo --workload plain --workload plain-main --workload lightning
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hpc_elastic import events
from hpc_elastic.ops import phases
from hpc_elastic.rendezvous.local_store import SCHEME, LocalStoreServer
from hpc_elastic.rendezvous.testing import ZooKeeperServer

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "tests" / "workloads" / "train_gloo.py"


@dataclass(frozen=True)
class Workload:
    """A training script the launchers run (``--workload``)."""

    name: str
    script: Path
    prewarm: tuple[str, ...] = ("torch",)
    """The agent's ``--prewarm`` modules for it."""
    needs: str | None = None
    """A module that must be installed, else the workload is skipped."""

    @property
    def missing(self) -> bool:
        return self.needs is not None and importlib.util.find_spec(self.needs) is None


WORKLOADS = {
    workload.name: workload
    for workload in (
        Workload("gloo", TRAIN),
        Workload("plain", REPO / "tests" / "workloads" / "plain_module.py"),
        Workload("plain-main", REPO / "tests" / "workloads" / "plain_main.py"),
        Workload(
            "lightning",
            REPO / "tests" / "workloads" / "plain_lightning.py",
            prewarm=("torch", "lightning.pytorch"),
            needs="lightning",
        ),
    )
}
GLOO = WORKLOADS["gloo"]

TIMELINE_WAIT = 1.0
"""Seconds the agents keep running after the probe's answer, so that they write the new
round's timeline events (``store_connected`` is seen at the agent's next poll)."""
AGENTS = 4
FULL = 3
"""The group's size in the hot-spare scenarios (``--nodes 3:3``): the 4th agent is the spare."""

SETTLE = 15.0
"""Seconds of training before the fault: a failure in the first seconds is rare, and the next
set of standby workers needs that long to import torch on this loaded two-core machine."""

Probe = Callable[["Launch", float], "float | None"]


@dataclass
class Launch:
    """One run of 4 agents; ``progress`` rows are (time, step, world, rank 0's pid)."""

    agents: list[subprocess.Popen[bytes]]
    out: Path
    standbys: bool = False
    script: Path = TRAIN
    """The training script the agents run (``Workload.script``)."""
    add: Callable[[], subprocess.Popen[bytes]] | None = None
    """Starts one more agent of the same job (the node-arrival scenario)."""

    def progress(self) -> list[tuple[float, int, int, int]]:
        path = self.out / "progress"
        if not path.exists():
            return []
        rows = [line.split() for line in path.read_text().splitlines() if line.count(" ") == 4]
        return [(float(t), int(s), int(w), int(pid)) for t, s, w, _, pid in rows]

    def workers(self, agent: subprocess.Popen[bytes]) -> list[int]:
        """The agent's training processes: they run the script and write to a log file
        (standby workers also run it, but their output still goes to /dev/null)."""
        return [
            pid
            for pid in _descendants(agent.pid)
            if str(self.script) in _cmdline(pid)
            and "torch.distributed.run" not in _cmdline(pid)
            and not (self.standbys and _stdout(pid) == os.devnull)
        ]

    def standbys_warm(self) -> bool:
        """Every agent's standbys (the script's processes whose output still goes to
        /dev/null) have imported their modules: each made its file in the agent's ready
        directory (``HPC_ELASTIC_STANDBY_READY_DIR``). A fault before that restarts cold, and
        a workload whose standbys import more (Lightning) needs longer than ``SETTLE``."""
        for agent in self.agents:
            standbys = [
                pid
                for pid in _descendants(agent.pid)
                if str(self.script) in _cmdline(pid) and _stdout(pid) == os.devnull
            ]
            if not standbys or not all(_standby_ready(pid) for pid in standbys):
                return False
        return True

    def workers_of(self, agent: subprocess.Popen[bytes], script: Path) -> list[int]:
        """Like ``workers``, for another training script (the in-place column's)."""
        return [
            pid
            for pid in _descendants(agent.pid)
            if str(script) in _cmdline(pid) and not (self.standbys and _stdout(pid) == os.devnull)
        ]

    def stop(self) -> None:
        """Kill the agents and everything they started (torchrun's workers may outlive it)."""
        everything = [pid for agent in self.agents for pid in _descendants(agent.pid)]
        for agent in self.agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
        for pid in everything:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for agent in self.agents:
            agent.wait()


def ours(
    zk: str,
    nodes: str,
    out: Path,
    prewarm: bool,
    *,
    count: int = AGENTS,
    workload: Workload = GLOO,
    rendered: bool = False,
) -> Launch:
    """``count`` agents of one job. ``rendered``: with ``submit``'s defaults for every timing
    (session timeout, last call, grace) instead of the bench's short ones."""
    run_id = uuid.uuid4().hex[:8]
    modules = [f"--prewarm={module}" for module in workload.prewarm] if prewarm else []
    timings = [] if rendered else ["--session-timeout=2", "--last-call=1", "--grace=3"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def agent(index: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                sys.executable, "-m", "hpc_elastic", "agent",
                f"--run-id={run_id}", f"--job-dir={out / 'job'}", f"--zk={_chroot(zk)}",
                f"--nodes={nodes}", "--zk-open-acl", *timings,
                f"--slot=a{index}", "--host=127.0.0.1", *modules,
                "--", sys.executable, "-u", str(workload.script), f"--out={out}",
                "--steps=100000",
            ],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip

    launch = Launch(
        [agent(index) for index in range(count)], out, standbys=prewarm, script=workload.script
    )
    launch.add = lambda: _added(launch, agent(len(launch.agents)))
    return launch


def _added(launch: Launch, agent: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    launch.agents.append(agent)
    return agent


def torchrun(nodes: str, out: Path, count: int = AGENTS, workload: Workload = GLOO) -> Launch:
    port = _free_port()
    run_id = uuid.uuid4().hex[:8]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def agent() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
                "--nproc-per-node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
                "--max-restarts=3", "--monitor-interval=0.1", "--local-addr=127.0.0.1",
                str(workload.script), f"--out={out}", "--steps=100000",
            ],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip

    agents = []
    for _ in range(count):
        agents.append(agent())
        time.sleep(0.3 if not agents[1:] else 0.0)  # The first one hosts the c10d store.
    launch = Launch(agents, out, script=workload.script)
    launch.add = lambda: _added(launch, agent())
    return launch


def _trained(launch: Launch, world: int = AGENTS) -> bool:
    """Training has run for ``SETTLE`` seconds at this world size, and the standbys are warm."""
    rows = launch.progress()
    settled = bool(rows) and rows[-1][2] == world and time.time() - rows[0][0] > SETTLE
    return settled and (not launch.standbys or launch.standbys_warm())


def _wait(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def worker_kill(launch: Launch, give_up: float) -> float | None:
    """Seconds from a worker's SIGKILL to the first step of the restarted group (a new rank 0
    process: torchrun's restart count does not move on nodes whose own workers did not fail)."""
    if not _wait(lambda: _trained(launch), 120):
        return None
    victim = launch.workers(launch.agents[-1])[0]
    before = launch.progress()[-1][3]
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    if not _wait(lambda: launch.progress()[-1][3] != before, give_up):
        return None
    return next(t for t, _, _, pid in launch.progress() if t > killed and pid != before) - killed


def agent_kill(launch: Launch, give_up: float) -> float | None:
    """Seconds from an agent's SIGKILL to the first step at world size 3."""
    if not _wait(lambda: _trained(launch), 120):
        return None
    victim = launch.agents[-1]
    node = _descendants(victim.pid)
    killed = time.time()
    os.killpg(victim.pid, signal.SIGKILL)
    for pid in node:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if not _wait(lambda: launch.progress()[-1][2] == 3, give_up):
        return None
    return next(t for t, _, w, _ in launch.progress() if t > killed and w == 3) - killed


def agent_freeze(launch: Launch, give_up: float) -> float | None:
    """Seconds from freezing a node (SIGSTOP to its agent and workers: a silent loss, no
    connection closes) to the first step at world size 3. Only the frozen agent's session
    expiry tells the others."""
    if not _wait(lambda: _trained(launch), 120):
        return None
    victim = launch.agents[-1]
    node = [victim.pid, *_descendants(victim.pid)]
    frozen = time.time()
    for pid in node:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    if not _wait(lambda: launch.progress()[-1][2] == 3, give_up):
        return None
    return next(t for t, _, w, _ in launch.progress() if t > frozen and w == 3) - frozen


def _member_kill(launch: Launch, give_up: float, replace: bool) -> float | None:
    """Seconds from a member agent's SIGKILL to the first step of the re-formed group at full
    size (3 nodes, ``--nodes 3:3``): a hot spare beside the round takes the lost node's place,
    or (``replace``) a new agent started at the moment of the kill does."""
    if not _wait(lambda: _trained(launch, world=FULL), 120):
        return None
    victim = next(agent for agent in launch.agents if launch.workers(agent))
    node = _descendants(victim.pid)
    before = launch.progress()[-1][3]
    killed = time.time()
    os.killpg(victim.pid, signal.SIGKILL)
    for pid in node:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if replace:
        assert launch.add is not None
        launch.add()

    def restarted() -> bool:
        return any(t > killed and w == FULL and p != before for t, _, w, p in launch.progress())

    if not _wait(restarted, give_up):
        return None
    return (
        next(t for t, _, w, p in launch.progress() if t > killed and w == FULL and p != before)
        - killed
    )


def spare_takes_over(launch: Launch, give_up: float) -> float | None:
    return _member_kill(launch, give_up, replace=False)


def new_agent_takes_over(launch: Launch, give_up: float) -> float | None:
    return _member_kill(launch, give_up, replace=True)


def node_arrival(launch: Launch, give_up: float) -> float | None:
    """Seconds from a new agent's start (next to 3 that train) to the first step at world 4."""
    if not _wait(lambda: _trained(launch, world=AGENTS - 1), 120):
        return None
    assert launch.add is not None
    started = time.time()
    launch.add()
    if not _wait(lambda: launch.progress()[-1][2] == AGENTS, give_up):
        return None
    rows = launch.progress()
    grown = next(t for t, _, w, _ in rows if t > started and w == AGENTS)
    last_small = max(t for t, _, w, _ in rows if t < grown and w == AGENTS - 1)
    print(f"      the 3 nodes' pause: {grown - last_small:.2f} s (last step at 3 -> first at 4)")
    return grown - started


def idle_cost(launch: Launch, seconds: float = 5.0) -> tuple[float, float]:
    """(CPU %, RSS MB) of one agent process while its worker trains."""
    _wait(lambda: len(launch.progress()) >= 10, 90)
    pid = launch.agents[1].pid
    first = _cpu_seconds(pid)
    time.sleep(seconds)
    cpu = (_cpu_seconds(pid) - first) / seconds * 100
    rss = int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024
    return cpu, rss


def measure(
    name: str,
    start: Callable[[Path], Launch],
    probe: Probe,
    give_up: float,
) -> float | None:
    with tempfile.TemporaryDirectory(prefix="agent-bench-") as tmp:
        launch = start(Path(tmp))
        try:
            result = probe(launch, give_up)
            if result is not None:
                time.sleep(TIMELINE_WAIT)
        finally:
            launch.stop()
        timeline = phases.table(phases.restarts(events.read(Path(tmp) / "job" / "events.jsonl")))
    print(f"  {name}: {'did not recover' if result is None else f'{result:.2f} s'}", flush=True)
    if len(timeline) > 1:  # The agent's restarts, phase by phase (torchrun writes no events).
        for row in timeline:
            print(f"      {row}", flush=True)
    return result


def cell(results: list[float | None]) -> str:
    """``median (min-max), recovered of tries``."""
    done = [value for value in results if value is not None]
    if not done:
        return f"- (0 of {len(results)})"
    spread = f"{min(done):.1f}-{max(done):.1f}"
    return f"{statistics.median(done):.1f} s ({spread}, {len(done)} of {len(results)})"


LAUNCHERS = (
    "torchrun c10d",
    "agent, cold workers",
    "agent, --prewarm torch",
    "agent as submit renders it",
)
"""The columns. The first three agents run with a session of 2 s, a last call of 1 s and a
grace of 3 s; the last one with ``submit``'s defaults (``contract.DEFAULT_SESSION_TIMEOUT``,
``DEFAULT_LAST_CALL``, ``--prewarm torch``)."""
SCENARIOS: tuple[tuple[str, str, int, Probe], ...] = (
    # (row, --nodes, agents at the start, probe)
    ("worker SIGKILL -> next step, all 4 ranks", "4", AGENTS, worker_kill),
    ("node SIGKILL -> step at 3 nodes", "3:4", AGENTS, agent_kill),
    ("4th node arrives -> step at 4 nodes", "3:4", AGENTS - 1, node_arrival),
    ("frozen node (SIGSTOP) -> step at 3 nodes", "3:4", AGENTS, agent_freeze),
    # Hot spares (submit --spares): 3 nodes train, a 4th agent waits beside the full round.
    ("node SIGKILL -> step at full size (3:3), hot spare", "3:3", AGENTS, spare_takes_over),
    (
        "node SIGKILL -> step at full size (3:3), new agent at the kill",
        "3:3",
        FULL,
        new_agent_takes_over,
    ),
)
AGENT_ONLY = frozenset(
    row for row, _, _, probe in SCENARIOS if probe in (spare_takes_over, new_agent_takes_over)
)
"""Scenarios torchrun has no counterpart for (its extra nodes never replace a lost one at
once: they wait for the next rendezvous, which a lost node does not start); its cell is "-"."""


def launcher(
    zk: str, name: str, nodes: str, count: int, workload: Workload = GLOO
) -> Callable[[Path], Launch]:
    """Starts the ``LAUNCHERS`` column ``name``: ``count`` nodes of one job in a folder."""
    if name == LAUNCHERS[0]:
        return functools.partial(torchrun, nodes, count=count, workload=workload)
    return functools.partial(
        ours,
        zk,
        nodes,
        count=count,
        workload=workload,
        prewarm=name in LAUNCHERS[2:],
        rendered=name == LAUNCHERS[3],
    )


def import_torch_seconds(tries: int = 3) -> float:
    """The median wall time of ``import torch`` in a fresh interpreter: what a new node pays
    before it can do anything, and what the arrival row is counted against."""
    times = []
    for _ in range(tries):
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        times.append(time.monotonic() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zk", default=os.environ.get("HPC_ELASTIC_ZK_HOSTS", "127.0.0.1:2181"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--give-up", type=float, default=60.0)
    parser.add_argument("--no-idle", action="store_true", help="Skip the idle-cost rows.")
    parser.add_argument(
        "--only",
        choices=[*LAUNCHERS, IN_PLACE_LAUNCHER],
        action="append",
        help="Run only these launchers (the in-place one with --side-by-side).",
    )
    parser.add_argument(
        "--scenario",
        choices=[row for row, *_ in SCENARIOS],
        action="append",
        help="Run only these scenarios.",
    )
    parser.add_argument(
        "--in-place",
        action="store_true",
        help="Run only the in-place column (--in-place agents, tests/workloads/train_inplace.py).",
    )
    parser.add_argument("--prewarm", action="store_true", help="With --in-place: --prewarm torch.")
    parser.add_argument(
        "--settle", type=float, help="With --in-place: seconds of training before the fault."
    )
    parser.add_argument(
        "--fault",
        choices=("worker-kill", "node-kill", "arrival"),
        help="With --in-place: only this scenario.",
    )
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="The restart table: the three scenarios for torchrun, cold, prewarmed and in-place.",
    )
    parser.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        action="append",
        help="The training script (repeatable; default gloo): each one's rows beside the others'.",
    )
    args = parser.parse_args()
    args.workloads = chosen_workloads(args.workload)
    with _zookeeper(args.zk) as zk:
        args.zk = zk
        if args.side_by_side:
            side_by_side(
                zk, args.repeats, args.give_up, args.only, args.scenario, workloads=args.workloads
            )
            return
        run(args)


def chosen_workloads(names: list[str] | None) -> list[Workload]:
    """The workloads of ``--workload`` (gloo alone by default), less those not installed."""
    chosen = []
    for name in dict.fromkeys(names or ["gloo"]):
        workload = WORKLOADS[name]
        if workload.missing:
            print(
                f"workload {name}: skipped, {workload.needs} is not installed "
                "(pip install --no-deps lightning lightning-utilities torchmetrics tqdm)",
                flush=True,
            )
            continue
        chosen.append(workload)
    return chosen


def row_name(scenario: str, workload: Workload, workloads: list[Workload]) -> str:
    """The table's row: the scenario, and the workload's name when it is not the only gloo."""
    return scenario if workloads == [GLOO] else f"{scenario} [{workload.name}]"


def run(args: argparse.Namespace) -> None:
    """The launcher x scenario table (and idle rows), or the in-place column alone."""
    if args.in_place:
        rows = in_place_column(
            args.zk, args.repeats, args.give_up, args.prewarm, settle=args.settle, only=args.fault
        )
        print("| scenario | in-place: fault -> step, all ranks | survivors: known -> step |")
        print("|---|---|---|")
        print("\n".join(rows))
        return
    chosen = [name for name in args.only or LAUNCHERS if name in LAUNCHERS]
    scenarios = [row for row in SCENARIOS if not args.scenario or row[0] in args.scenario]

    rows = []
    for workload in args.workloads:
        for scenario, nodes, count, probe in scenarios:
            cells = []
            row = row_name(scenario, workload, args.workloads)
            for name in chosen:
                if name == LAUNCHERS[0] and scenario in AGENT_ONLY:
                    cells.append("-")
                    continue
                print(f"{row}: {name}", flush=True)
                start = launcher(args.zk, name, nodes, count, workload)
                results = [
                    measure(f"try {n + 1}", start, probe, args.give_up) for n in range(args.repeats)
                ]
                cells.append(cell(results))
            rows.append(f"| {row} | {' | '.join(cells)} |")
    print(f"| scenario | {' | '.join(chosen)} |")
    print(f"|---|{'---|' * len(chosen)}")
    print("\n".join(rows))
    if args.no_idle:
        return
    for name in chosen:
        with tempfile.TemporaryDirectory(prefix="agent-bench-") as tmp:
            launch = launcher(args.zk, name, "4", AGENTS)(Path(tmp))
            try:
                cpu, rss = idle_cost(launch)
            finally:
                launch.stop()
        print(f"| {name}: idle agent CPU / RSS | {cpu:.2f} % / {rss:.0f} MB |")


@contextlib.contextmanager
def _zookeeper(zk: str) -> Iterator[str]:
    """``zk`` itself, or with ``private`` a ZooKeeper of this run's own (stopped at the end)."""
    if zk != "private":
        yield zk
        return
    data = Path(tempfile.mkdtemp(prefix="agent-bench-zk-"))
    server = ZooKeeperServer(data)
    server.start()
    print(f"private ZooKeeper at {server.hosts} (tickTime=500)", flush=True)
    try:
        yield server.hosts
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)


def _chroot(zk: str) -> str:
    """The agents' ``--zk``: a ZooKeeper's hosts under the bench's chroot, or a local store."""
    return zk if zk.startswith(SCHEME) else f"{zk}/bench"


def side_by_side(
    zk: str,
    repeats: int,
    give_up: float,
    only: list[str] | None = None,
    scenarios: list[str] | None = None,
    *,
    workloads: list[Workload] | None = None,
) -> None:
    """The restart table in one run: rows are the four scenarios, columns the launchers, the
    in-place column last (its own workload and probe: fault -> a step by every rank of the new
    round, and, after ";", the survivors' first step after their agent knew the round).
    ``only`` and ``scenarios`` (``--only``, ``--scenario``) pick columns and rows; with other
    ``workloads`` than gloo, each one's rows follow (the in-place column only for gloo: the
    others do not use ``InPlace``)."""
    workloads = workloads or [GLOO]
    columns = [name for name in (*LAUNCHERS, IN_PLACE_LAUNCHER) if not only or name in only]
    print(f"import torch in a fresh interpreter: {import_torch_seconds():.2f} s (median of 3)")
    rows = []
    for workload in workloads:
        for scenario, nodes, count, probe in SCENARIOS:
            if scenario in AGENT_ONLY or (scenarios and scenario not in scenarios):
                continue
            row = row_name(scenario, workload, workloads)
            cells = [
                _side_by_side_cell(
                    zk,
                    name,
                    row,
                    (nodes, count, probe),
                    workload=workload,
                    repeats=repeats,
                    give_up=give_up,
                )
                for name in columns
            ]
            rows.append(f"| {row} | {' | '.join(cells)} |")
    print(f"| scenario | {' | '.join(columns)} |")
    print(f"|---|{'---|' * len(columns)}")
    print("\n".join(rows))


# --- In-place recovery (``--in-place``, tests/workloads/train_inplace.py) -----------------------
# A separate column: the workload differs (it must use ``hpc_elastic.train.InPlace``) and so does
# what is timed: besides fault -> step, how soon the surviving ranks step again once their agent
# knows the new round (its ``workers_kept`` event), which is what in-place mode shortens.

TRAIN_IN_PLACE = REPO / "tests" / "workloads" / "train_inplace.py"
IN_PLACE_SETTLE = 5.0
"""Seconds of training before the fault; with ``--prewarm``, ``SETTLE`` x 2: the standbys that
replace the ones the first round took start only after it trains, and import torch slowly
on this loaded machine."""


@dataclass(frozen=True)
class TraceLine:
    """A step of tests/workloads/train_inplace.py: (time, step, round, rank, world, pid)."""

    time: float
    step: int
    round: int
    rank: int
    world: int
    pid: int


def _side_by_side_cell(
    zk: str,
    name: str,
    row: str,
    scenario: tuple[str, int, Probe],
    *,
    workload: Workload,
    repeats: int,
    give_up: float,
) -> str:
    """One cell of ``side_by_side``: ``repeats`` tries of one launcher on one scenario."""
    nodes, count, probe = scenario
    if name == IN_PLACE_LAUNCHER:
        fault = IN_PLACE_FAULTS.get(probe)
        if workload != GLOO or fault is None:
            return "-"
        print(f"{row}: {IN_PLACE_LAUNCHER}", flush=True)
        return in_place_cell(
            zk, nodes, count, fault, repeats=repeats, give_up=give_up, prewarm=True
        )
    print(f"{row}: {name}", flush=True)
    start = launcher(zk, name, nodes, count, workload)
    return cell([measure(f"try {n + 1}", start, probe, give_up) for n in range(repeats)])


def in_place_agents(zk: str, nodes: str, out: Path, count: int, prewarm: bool = False) -> Launch:
    """``count`` agents with ``--in-place`` running the in-place workload."""
    run_id = uuid.uuid4().hex[:8]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def agent(index: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                sys.executable, "-m", "hpc_elastic", "agent",
                f"--run-id={run_id}", f"--job-dir={out / 'job'}",
                f"--zk={_chroot(zk)}",
                f"--nodes={nodes}", "--zk-open-acl", "--session-timeout=2", "--last-call=1",
                "--grace=3", "--in-place", "--no-preflight",
                f"--slot=a{index}", "--host=127.0.0.1", *(["--prewarm=torch"] if prewarm else []),
                "--", sys.executable, "-u", str(TRAIN_IN_PLACE), f"--out={out}",
                "--steps=100000", "--sleep=0.1",
            ],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip

    launch = Launch([agent(index) for index in range(count)], out, standbys=prewarm)
    launch.add = lambda: _added(launch, agent(len(launch.agents)))
    return launch


def in_place_trace(out: Path) -> list[TraceLine]:
    path = out / "trace"
    lines = path.read_text().splitlines() if path.exists() else []
    rows = [line.split() for line in lines if line.count(" ") == 7]
    return [
        TraceLine(float(t), int(step), int(rnd), int(rank), int(world), int(pid))
        for t, step, rnd, rank, world, pid, _, _ in rows
    ]


@dataclass(frozen=True)
class InPlaceResult:
    """Seconds from the fault (or arrival) to a step by every rank of the new round, and from
    the first ``workers_kept`` event of that round to the survivors' first step in it."""

    to_step: float
    survivors_after_known: float


def in_place_probe(
    launch: Launch, fault: str, world: int, give_up: float, settle: float | None = None
) -> InPlaceResult | None:
    """Train ``settle`` seconds, inject ``fault`` (worker-kill, node-kill or arrival), time the
    new round."""
    if settle is None:
        settle = SETTLE * 2 if launch.standbys else IN_PLACE_SETTLE

    def settled() -> bool:
        rows = in_place_trace(launch.out)
        return bool(rows) and rows[-1].world == world and rows[-1].time - rows[0].time > settle

    if not _wait(settled, 180):
        return None
    before = in_place_trace(launch.out)
    old_round = before[-1].round
    if fault == "arrival":
        assert launch.add is not None
        started = time.time()
        launch.add()
        world += 1
    else:
        victim_agent = launch.agents[-1]
        started = time.time()
        if fault == "worker-kill":
            os.kill(launch.workers_of(victim_agent, TRAIN_IN_PLACE)[0], signal.SIGKILL)
        else:
            node = _descendants(victim_agent.pid)
            os.killpg(victim_agent.pid, signal.SIGKILL)
            for pid in node:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            world -= 1
    survivors = {line.pid for line in before}

    def stepped() -> list[TraceLine]:
        return [
            line for line in in_place_trace(launch.out)
            if line.round > old_round and line.world == world
        ]  # fmt: skip

    if not _wait(lambda: len({line.rank for line in stepped()}) == world, give_up):
        return None
    new = stepped()
    kept = [
        event.time
        for event in events.read(launch.out / "job" / "events.jsonl")
        if event.kind == events.Kind.WORKERS_KEPT and (event.round or 0) > old_round
    ]
    first_survivor = min((line.time for line in new if line.pid in survivors), default=None)
    if not kept or first_survivor is None:
        return None  # nobody survived: not an in-place restart
    ranks_done = max(min(line.time for line in new if line.rank == r) for r in range(world))
    return InPlaceResult(ranks_done - started, first_survivor - min(kept))


def fine_cell(results: list[float | None]) -> str:
    """Like ``cell``, to the hundredth: the survivors' figure is a fraction of a second."""
    done = [value for value in results if value is not None]
    if not done:
        return f"- (0 of {len(results)})"
    spread = f"{min(done):.2f}-{max(done):.2f}"
    return f"{statistics.median(done):.2f} s ({spread}, {len(done)} of {len(results)})"


IN_PLACE_LAUNCHER = "agent, --in-place --prewarm torch"
IN_PLACE_FAULTS: dict[Probe, str] = {
    worker_kill: "worker-kill",
    agent_kill: "node-kill",
    node_arrival: "arrival",
}
"""The in-place probe's fault for each scenario of the side-by-side table."""


def in_place_column(
    zk: str,
    repeats: int,
    give_up: float,
    prewarm: bool,
    *,
    settle: float | None = None,
    only: str | None = None,
) -> list[str]:
    """One line per scenario: fault -> every rank stepped, and known -> survivors stepped."""
    scenarios = (
        ("worker SIGKILL -> next step, all 3 ranks", "3", 3, "worker-kill"),
        ("node SIGKILL -> step at 2 nodes", "2:3", 3, "node-kill"),
        ("3rd node arrives -> step at 3 nodes", "2:3", 2, "arrival"),
    )
    lines = []
    for scenario, nodes, count, fault in scenarios:
        if only is not None and fault != only:
            continue
        print(f"{scenario}: agent, --in-place{' --prewarm torch' if prewarm else ''}", flush=True)
        results = in_place_tries(
            zk,
            nodes,
            count,
            fault,
            repeats=repeats,
            give_up=give_up,
            prewarm=prewarm,
            settle=settle,
        )
        to_step = cell([None if r is None else r.to_step for r in results])
        known = fine_cell([None if r is None else r.survivors_after_known for r in results])
        lines.append(f"| {scenario} | {to_step} | {known} |")
    return lines


def in_place_cell(
    zk: str, nodes: str, count: int, fault: str, *, repeats: int, give_up: float, prewarm: bool
) -> str:
    """The side-by-side table's in-place cell: ``fault -> step; survivors: known -> step``."""
    results = in_place_tries(
        zk, nodes, count, fault, repeats=repeats, give_up=give_up, prewarm=prewarm
    )
    to_step = cell([None if r is None else r.to_step for r in results])
    known = fine_cell([None if r is None else r.survivors_after_known for r in results])
    return f"{to_step}; survivors {known.split(' (')[0]}"


def in_place_tries(
    zk: str,
    nodes: str,
    count: int,
    fault: str,
    *,
    repeats: int,
    give_up: float,
    prewarm: bool,
    settle: float | None = None,
) -> list[InPlaceResult | None]:
    """``repeats`` tries of one in-place scenario, each printed with its restart timeline."""
    # ``--zk local``: this process serves the rendezvous (local mode's store), one per
    # scenario, so the column needs no ZooKeeper.
    server = None
    if zk == "local":
        socket_dir = Path(tempfile.mkdtemp(prefix="agent-bench-"))
        server = LocalStoreServer(socket_dir / "rendezvous.sock")
        server.start()
        address = f"{SCHEME}{socket_dir / 'rendezvous.sock'}"
    else:
        address = zk
    results: list[InPlaceResult | None] = []
    for attempt in range(repeats):
        with tempfile.TemporaryDirectory(prefix="agent-bench-") as tmp:
            launch = in_place_agents(address, nodes, Path(tmp), count, prewarm)
            try:
                result = in_place_probe(launch, fault, count, give_up, settle)
            finally:
                launch.stop()
            history = events.read(Path(tmp) / "job" / "events.jsonl")
            timeline = phases.table(phases.restarts(history))
        said = "did not recover in place" if result is None else (
            f"{result.to_step:.2f} s to a step by every rank, survivors stepped "
            f"{result.survivors_after_known:.2f} s after their agent knew the round"
        )  # fmt: skip
        print(f"  try {attempt + 1}: {said}", flush=True)
        for row in timeline if len(timeline) > 1 else ():
            print(f"      {row}", flush=True)
        results.append(result)
    if server is not None:
        server.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)
    return results


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return found
    for child in map(int, children):
        found += [child, *_descendants(child)]
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _standby_ready(pid: int) -> bool:
    """Whether standby ``pid`` made its ready file (agent/standby.py)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    prefix = b"HPC_ELASTIC_STANDBY_READY_DIR="
    found = [entry[len(prefix) :] for entry in environ if entry.startswith(prefix)]
    return bool(found) and (Path(found[0].decode()) / str(pid)).exists()


def _stdout(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return ""


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


if __name__ == "__main__":
    main()
