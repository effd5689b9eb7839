"""In-place mode's hand-over of a new round to the surviving workers (``--in-place``;
docs/agent.md, "In-place recovery").

Across a membership change or a failure the agent keeps the workers that are alive, when
their loops take rounds (``InPlaceHandover.takes_rounds``). For the next round it writes each
local rank its assignment and starts workers only for the ranks without a survivor
(``hand_over``); a survivor has ``ACK_TIMEOUT`` to acknowledge its round, or it is killed
(``overdue``) and restarted the normal way. The agent (agent.py) decides when, and records
the events; the file format is ``protocol/assignment.py``, the worker's half
``train/inplace.py``.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import replace
from pathlib import Path

from hpc_elastic.agent.api import AgentSpec
from hpc_elastic.agent.standby import StandbyPool
from hpc_elastic.agent.workers import WorkerGroup, WorkerPaths
from hpc_elastic.contract import ASSIGNMENT_FILE_ENV
from hpc_elastic.protocol.assignment import (
    ROUND_KEYS,
    Assignment,
    ack_path,
    read_ack,
    write_assignment,
)

ACK_TIMEOUT = 30.0
"""Seconds a surviving worker has to take up the new round (it acknowledges at its next step
boundary, or at once when a collective failed on a dead peer). One that does not (stuck in a
long step, or a loop without ``InPlace``) is killed and restarted the normal way."""

log = logging.getLogger(__name__)


class InPlaceHandover:
    """This node's side of in-place mode: whether the current workers can take the new
    round, and handing it to them, survivors and newcomers alike.

    Everything it needs comes in at its construction (where the assignment files live, the
    node's name for the logs, what starts a newcomer) or with each call (the round, the
    workers); it keeps only the acknowledgements it waits for. It records no event: the agent
    does, from what the calls return.
    """

    def __init__(
        self, run_dir: Path, node: str, spec: AgentSpec, standbys: StandbyPool | None
    ) -> None:
        """``run_dir``: the agent's private run directory, where the assignment files and
        the newcomers' heartbeat files are; ``node``: this node's name in the debug logs;
        ``spec`` and ``standbys``: what a newcomer is started with (``WorkerGroup.add``)."""
        self._run_dir = run_dir
        self._node = node
        self._spec = spec
        self._standbys = standbys
        self._acks: dict[int, tuple[int, float]] = {}
        """Local rank -> (round, deadline) of each survivor yet to take it up."""

    def assignment_file(self, local_rank: int) -> Path:
        """The file that hands local rank ``local_rank`` its next round."""
        return self._run_dir / f"assignment_{local_rank}"

    def worker_paths(
        self, paths: list[WorkerPaths], round_number: int, first: int
    ) -> list[WorkerPaths]:
        """``paths`` (of the local ranks, global ranks from ``first`` on) with each heartbeat
        file named by round as well as rank: a survivor keeps the heartbeat file it was
        started with, whatever its new rank, so a newcomer's file must never be one of those."""
        return [
            replace(each, heartbeat=self._run_dir / f"heartbeat_{round_number}_{i}")
            for i, each in enumerate(paths, start=first)
        ]

    def takes_rounds(self, group: WorkerGroup) -> bool:
        """Every running worker's loop uses ``InPlace`` (it acknowledged the round it started
        in). A loop without it would never take up a round: restarting it the normal way at
        once beats killing it at the deadline, round after round."""
        running = group.running()
        return bool(running) and all(
            read_ack(self.assignment_file(worker.local_rank)) is not None for worker in running
        )

    def hand_over(
        self,
        round_number: int,
        envs: list[dict[str, str]],
        paths: list[WorkerPaths],
        group: WorkerGroup | None,
    ) -> tuple[WorkerGroup, list[int]]:
        """Write every local rank its round (a survivor of ``group`` takes it up at its next
        step boundary), start workers only for the local ranks that have no survivor. Returns
        the round's group and the survivors' new ranks, sorted (empty when none was kept).
        Each local rank's environment in ``envs`` gains the name of its assignment file."""
        group = group if group is not None else WorkerGroup([])
        survivors = {worker.local_rank: worker for worker in group.keep_running()}
        deadline = time.monotonic() + ACK_TIMEOUT
        self._acks = {}
        try:
            for local, (env, worker_paths) in enumerate(zip(envs, paths, strict=True)):
                assignment_file = self.assignment_file(local)
                env[ASSIGNMENT_FILE_ENV] = str(assignment_file)
                round_env = {key: env[key] for key in ROUND_KEYS}
                write_assignment(assignment_file, Assignment(round_number, round_env))
                survivor = survivors.get(local)
                if survivor is None:
                    # A new worker has yet to show that its loop takes rounds (takes_rounds).
                    ack_path(assignment_file).unlink(missing_ok=True)
                    group.add(self._spec, env, worker_paths, local, self._standbys)
                    continue
                log.debug(
                    "%s: rank %d (pid %d) goes on in place as rank %s of round %d",
                    self._node,
                    survivor.rank,
                    survivor.process.pid,
                    env["RANK"],
                    round_number,
                )
                survivor.rank = int(env["RANK"])
                self._acks[local] = (round_number, deadline)
        except BaseException:
            group.stop(0.0)
            raise
        return group, sorted(worker.rank for worker in survivors.values())

    def overdue(self, group: WorkerGroup) -> tuple[int, str] | None:
        """Forget the survivors that took up their round; SIGKILL the first one that did not
        in time and return its rank and the reason, for the agent to end the round with its
        failure (which restarts it the normal way, from a survivor's broadcast or the
        checkpoint). None while every survivor is in time."""
        if not self._acks:
            return None
        now = time.monotonic()
        for worker in group.workers:
            pending = self._acks.get(worker.local_rank)
            if pending is None:
                continue
            round_number, deadline = pending
            if read_ack(self.assignment_file(worker.local_rank)) == round_number:
                log.debug("%s: rank %d took up round %d", self._node, worker.rank, round_number)
                del self._acks[worker.local_rank]
            elif now >= deadline and worker.returncode is None:
                worker.signal_group(signal.SIGKILL)
                worker.process.wait()
                reason = (
                    f"rank {worker.rank} did not take up round {round_number} in place within "
                    f"{ACK_TIMEOUT:g} s; its loop must call InPlace.step() at every step"
                )
                return worker.rank, reason
        return None
