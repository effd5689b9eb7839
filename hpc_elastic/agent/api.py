"""What an agent is asked to do (``AgentSpec``) and what it tells Slurm when it exits."""

from __future__ import annotations

import enum
import re
import signal
from dataclasses import dataclass
from pathlib import Path

from hpc_elastic import contract
from hpc_elastic.contract import PREEMPTED_EXIT_CODE, UNREACHABLE_EXIT_CODE
from hpc_elastic.errors import UsageError
from hpc_elastic.jobdir import JobDir

_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class AgentPhase(enum.Enum):
    """Where the agent is in its life cycle; shown in its events, metrics and debug log.

    Here rather than beside the loop in ``agent.py`` so that readers of events and metrics
    name the phases without importing the agent."""

    JOINING = "joining"
    RUNNING = "running"
    STOPPING = "stopping"
    REPORTING = "reporting"
    SUCCEEDING = "succeeding"
    DRAINING = "draining"
    DONE = "done"


class ExitCode(enum.IntEnum):
    """The agent's exit status, read by the sbatch script and by Slurm (``RequeueExit=75``)."""

    SUCCESS = 0
    FAILED = 1
    """The job failed: restart budget spent, or fewer than MIN nodes for ``--min-wait``."""
    USAGE = 2
    UNREACHABLE = UNREACHABLE_EXIT_CODE
    """Every server of the rendezvous stayed out of reach for ``--zk-outage-limit``: the
    slot is not requeued (``slurm/elastic.py: settle`` requeues 75 only) and the job is not
    failed for the others."""
    PREEMPTED = PREEMPTED_EXIT_CODE
    """Workers saved and stopped on the preemption signal: requeue the job. The same code as a
    worker's, so a plain ``srun`` exit status already tells the sbatch script to requeue."""
    INTERRUPTED = 130
    """SIGINT: stopped by hand, like a shell's Ctrl-C."""
    TERMINATED = 143
    """SIGTERM (scancel, time limit): stopped, the committed checkpoint is kept."""


@dataclass(frozen=True)
class AgentSpec:
    """Everything one agent needs, validated once when the command line is parsed."""

    job_dir: Path
    command: tuple[str, ...]
    nproc_per_node: int = contract.DEFAULT_NPROC_PER_NODE
    preempt_signal: signal.Signals = signal.SIGUSR2
    grace: float = contract.DEFAULT_GRACE
    """Seconds workers get to save and exit after SIGTERM or the preemption signal."""
    stop_grace: float = 2.0
    """Seconds workers get when the group re-forms: short, so no survivor hangs in a collective
    (a round that only arrivals ended gives ``rendezvous.state.arrival_grace`` instead)."""
    hang_timeout: float | None = None
    """A rank whose heartbeat is older than this is killed and counted as a failure."""
    tee: bool = False
    prewarm: tuple[str, ...] = ()
    """Modules warm standby workers import ahead of a restart (``torch``); see standby.py."""
    exclude_stragglers: bool = False
    """Move a slot whose rank straggles to another node (``--exclude-stragglers``): the agent
    command's bad-node watch does it, like a node that failed the slot too often."""
    in_place: bool = False
    """Keep the workers that are alive through a restart and write them the new round
    (``--in-place``); only loops that use ``hpc_elastic.train.InPlace`` take it up."""
    poll_interval: float = 0.1

    def __post_init__(self) -> None:
        if not self.command:
            raise UsageError(
                "No worker command was given; add it after '--', e.g. "
                "'hpc-elastic agent ... -- python -u train.py'."
            )
        if self.nproc_per_node < 1:
            raise UsageError(
                f"--nproc-per-node '{self.nproc_per_node}' must be at least 1; give the number "
                "of workers per node."
            )
        if self.grace < 0 or self.stop_grace < 0:
            raise UsageError(f"--grace '{self.grace}' is negative; give 0 or more seconds.")
        if self.hang_timeout is not None and self.hang_timeout <= 0:
            raise UsageError(
                f"--hang-timeout '{self.hang_timeout}' must be positive; give seconds, "
                "or leave it out to disable hang detection."
            )
        for module in self.prewarm:
            if not _MODULE.match(module):
                raise UsageError(f"--prewarm '{module}' is not a module name; give e.g. 'torch'.")
        if self.preempt_signal not in (signal.SIGUSR1, signal.SIGUSR2):
            raise UsageError(
                f"--preempt-signal '{self.preempt_signal.name}' is not supported; "
                "give USR1 or USR2."
            )

    @property
    def log_dir(self) -> Path:
        return JobDir(self.job_dir).logs

    @property
    def checkpoint_dir(self) -> Path:
        return JobDir(self.job_dir).checkpoints

    @property
    def events_file(self) -> Path:
        return JobDir(self.job_dir).events


def parse_signal(text: str) -> signal.Signals:
    """``USR2``, ``SIGUSR2`` or ``12`` -> ``signal.SIGUSR2``."""
    name = text.strip().upper()
    try:
        if name.isdigit():
            return signal.Signals(int(name))
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except (KeyError, ValueError):
        raise UsageError(
            f"--preempt-signal '{text}' is not a signal name; give USR1 or USR2."
        ) from None
