"""A fake Slurm at the Slurm layer's one subprocess call, in the spirit of submitit's
``mocked_slurm()``.

``mocked_slurm()`` replaces ``hpc_elastic.slurm.commands._spawn`` and nothing else: a test says
what each command prints (``fake.answer("scontrol", "show", "config", stdout=...)``) and reads
back what was run (``fake.calls``, and the scripts sbatch read, ``fake.submitted``). Everything
above that call (argv building, parsers, the one-sentence ``SlurmError``s, the callers' decision
rules) is the real code. The fake itself has no rules: an argv it was not told about fails the
test, so a new Slurm call cannot slip in unnoticed.

It is the tests' one Slurm seam: the CLI, the Python API, ``ops`` and the agent all reach Slurm
through that call, so no test replaces a function of a command, of the API or of ``ops`` to keep
Slurm away. ``mocked_submit()`` is the same fake, told what ``submit`` asks.
"""

from __future__ import annotations

import contextlib
import itertools
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpc_elastic.slurm import commands
from hpc_elastic.slurm.elastic import ElasticSlot
from hpc_elastic.slurm.env import SlurmContext
from hpc_elastic.slurm.ledger import SlotLimits

INSTALLED = ("sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel")
VERSION = "slurm 22.05.8"


@dataclass(frozen=True)
class Reply:
    """What one Slurm command printed and how it exited."""

    stdout: str = ""
    stderr: str = ""
    returncode: int = 0


Responder = Callable[[list[str]], Reply]
"""Computes the reply from the argv, e.g. a compute node that ``cat``s a real file."""


class FakeSlurm:
    """Canned replies by argv prefix (the longest matching prefix wins), and the calls made."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.inputs: list[str | None] = []
        """What each call read on its standard input, by its place in ``calls``."""
        self._responders: dict[tuple[str, ...], Responder] = {}
        self._hanging: set[tuple[str, ...]] = set()
        self._installed = set(INSTALLED)

    def answer(self, *prefix: str, stdout: str = "", stderr: str = "", returncode: int = 0) -> None:
        """Commands starting with ``prefix`` print this and exit with ``returncode``."""
        reply = Reply(stdout, stderr, returncode)
        self._responders[prefix] = lambda argv: reply

    def respond(self, *prefix: str, responder: Responder) -> None:
        """Commands starting with ``prefix`` get ``responder(argv)``."""
        self._responders[prefix] = responder

    def hang(self, *prefix: str) -> None:
        """Commands starting with ``prefix`` run past the layer's timeout."""
        self._hanging.add(prefix)

    def uninstall(self, *tools: str) -> None:
        """These tools are not on PATH: running them raises FileNotFoundError, as the OS does."""
        self._installed -= set(tools)

    def install(self, *tools: str) -> None:
        """These tools are on PATH too (``apptainer``): they answer what they are told to."""
        self._installed |= set(tools)

    def ran(self, program: str) -> list[list[str]]:
        """The calls of one program, in order."""
        return [argv for argv in self.calls if argv[0] == program]

    @property
    def submitted(self) -> list[str]:
        """The scripts sbatch read on its standard input, in order (a refused one included)."""
        return [
            text or ""
            for argv, text in zip(self.calls, self.inputs, strict=True)
            if argv[0] == "sbatch"
        ]

    def __call__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None,
        stdin: str | None,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        command = list(argv)
        self.calls.append(command)
        self.inputs.append(stdin)
        if command[0] not in self._installed:
            raise FileNotFoundError(2, "No such file or directory", command[0])
        if any(_starts_with(command, prefix) for prefix in self._hanging):
            raise subprocess.TimeoutExpired(command, timeout)
        reply = self._reply(command)
        return subprocess.CompletedProcess(command, reply.returncode, reply.stdout, reply.stderr)

    def _reply(self, command: list[str]) -> Reply:
        matches = [prefix for prefix in self._responders if _starts_with(command, prefix)]
        if matches:
            try:
                return self._responders[max(matches, key=len)](command)
            except OSError as error:
                # Would pass for the OS's "no such program" in the layer; it is a test's bug.
                raise AssertionError(f"the responder for {command} failed: {error}") from error
        if command[1:] == ["--version"]:
            return Reply(stdout=f"{VERSION}\n")
        raise AssertionError(f"the fake Slurm was not told what `{' '.join(command)}` prints")


def _starts_with(command: list[str], prefix: tuple[str, ...]) -> bool:
    return tuple(command[: len(prefix)]) == prefix


@contextlib.contextmanager
def mocked_slurm() -> Iterator[FakeSlurm]:
    """Route every Slurm command of ``hpc_elastic.slurm.commands`` to a fresh ``FakeSlurm``."""
    fake = FakeSlurm()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(commands, "_spawn", fake)
        yield fake


def job_ids(first: int) -> Responder:
    """What ``sbatch --parsable`` prints for each job it takes: ``first``, then ``first + 1``..."""
    numbers = itertools.count(first)
    return lambda argv: Reply(stdout=f"{next(numbers)}\n")


def squeue_text(*statuses: commands.JobStatus) -> str:
    """What ``squeue -h -o SQUEUE_FORMAT`` prints for these lines (``parse_squeue`` reads it)."""
    return "".join(
        f"{line.job_id}|{line.array_task or 'N/A'}|{line.state}|{line.reason}|{line.nodes}\n"
        for line in statuses
    )


@contextlib.contextmanager
def mocked_submit(
    partitions: Sequence[str] = ("low", "high"), first_job: int = 42
) -> Iterator[FakeSlurm]:
    """``mocked_slurm()`` told what ``submit`` asks: ``sinfo -h -o %R`` lists ``partitions``
    and ``sbatch --parsable`` answers job ``first_job``, then the next id. Anything else (a
    ``scancel``, a ``squeue``) fails the test unless the test says what it prints."""
    with mocked_slurm() as fake:
        fake.answer("sinfo", "-h", "-o", "%R", stdout="".join(f"{name}\n" for name in partitions))
        fake.respond("sbatch", responder=job_ids(first_job))
        yield fake


def array_slot(
    job_dir: Path,
    node: str = "n3",
    limits: SlotLimits | None = None,
    *,
    task: int = 2,
    restarts: int = 0,
) -> ElasticSlot:
    """Task ``task`` of array job 9 (``9_2`` unless told), running as Slurm job 12 on ``node``
    after ``restarts`` requeues: the slot the agent and Slurm-layer tests drive through the
    real ``ElasticSlot`` rules. Its context is fixed at construction (the slot's parts take
    it), so a test that needs another task builds another slot."""
    context = SlurmContext(
        job_id="12",
        node_name=node,
        node_id=0,
        num_nodes=1,
        nodelist=node,
        restart_count=restarts,
        array_job_id="9",
        array_task_id=task,
    )
    return ElasticSlot(context, job_dir, limits or SlotLimits())
