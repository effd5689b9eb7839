"""The Python API: submit a job and follow it from Python, as the CLI does from a shell.

``submit`` takes the option table's options (``hpc_elastic.options``) as keyword arguments,
by their Python names (``nodes="1:4"``, ``nproc_per_node=8``, ``partition="low"``), so a new
option is one row in the table and reaches the API, the CLI and the config file at once. A
value may be given as the flag's text (``nodes="2:8"``, ``time="1-00"``) or as a Python value
(``nodes=4``, ``env={"LR": "3e-4"}``); either is checked by the same parser as the flag.
Values the caller gives beat the config file (hpc-elastic.toml), which beats the defaults,
exactly as flags do.

``Job`` is a handle on one job directory; its methods return the typed objects the ops
commands print (``JobView``, ``Event``, ``RankOutput``), never text to parse. This module is
the CLI's way in too: ``submit`` and ``render`` plan with ``plan_given`` and send with
``send``; ``status``, ``list``, ``logs``, ``events`` and ``cancel`` find the job with
``Job.find`` (or ``jobs``) and call its methods, which call ``hpc_elastic.ops``. So the
commands and this API never drift apart, and neither copies the other's glue.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from hpc_elastic import contract
from hpc_elastic.errors import UsageError, WaitTimeoutError
from hpc_elastic.events import Event
from hpc_elastic.jobdir import JobRecord
from hpc_elastic.options import SUBMIT_OPTIONS, Option, resolve
from hpc_elastic.spec import JobSpec, default_job_name, parse_script

if TYPE_CHECKING:
    # Loaded by the functions that submit: status, list, logs, events and cancel, the CLI's
    # ones included, never need the renderer and the snapshot code it brings.
    from hpc_elastic.ensemble.choice import ZkChoice
    from hpc_elastic.submission import Plan

__all__ = [
    "FINAL_STATES",
    "Job",
    "Listing",
    "RankOutput",
    "is_over",
    "jobs",
    "listing",
    "plan_job",
    "send",
    "submit",
]

_log = logging.getLogger(__name__)

FINAL_STATES = frozenset({"succeeded", "failed", "stopped"})
"""The states ``ops.status`` gives a job that will do nothing more; ``Job.wait`` ends there."""


def is_over(view: Any) -> bool:
    """Whether a job (its ``JobView``) will do nothing more: a final state, or a Slurm job
    that Slurm no longer lists and whose agents never wrote an event (they died before the
    rendezvous: ``status`` calls that "unknown"; sbatch answers only once squeue lists it)."""
    return view.state in FINAL_STATES or (view.state == "unknown" and view.mode == "slurm")


WAIT_POLL_SECONDS = 2.0
"""How often ``wait`` looks: the events file and one ``squeue`` call, cheap at this rate."""

_OPTIONS = {option.name: option for option in SUBMIT_OPTIONS}


@dataclass(frozen=True)
class RankOutput:
    """One rank's log of one attempt (rendezvous round), read when ``Job.logs`` was called."""

    attempt: int
    rank: int
    path: Path
    text: str


@dataclass(frozen=True)
class Job:
    """One hpc-elastic job, found by its job directory's ``job.json``."""

    record: JobRecord

    @property
    def run_id(self) -> str:
        return self.record.run_id

    @property
    def job_id(self) -> str | None:
        """The Slurm job id; None for a local run."""
        return self.record.job_id

    @property
    def job_dir(self) -> Path:
        return self.record.job_dir

    @classmethod
    def find(cls, job: str, log_dir: Path | str | None = None) -> Job:
        """A job by run id, job directory or Slurm job id, as the CLI's JOB argument."""
        from hpc_elastic.ops import jobs as found  # noqa: PLC0415 (keep import cheap)

        return cls(found.resolve(job, found.log_dir(log_dir)))

    def status(self) -> Any:
        """A ``hpc_elastic.ops.status.JobView``: state, round, world size, slots, failures."""
        from hpc_elastic.ops import status  # noqa: PLC0415

        return status.gather(self.record)

    def state(self) -> str:
        """pending, running, held, succeeded, failed, stopped or unknown (``status().state``)."""
        return str(self.status().state)

    def events(self) -> list[Event]:
        """The job's single timeline across requeues, oldest first."""
        return self.record.events()

    def logs(self, rank: int | None = None, attempt: int | None = None) -> list[RankOutput]:
        """Every rank's output (or one rank's, or one attempt's), in attempt order."""
        from hpc_elastic.ops import logs  # noqa: PLC0415

        chosen = logs.select(self.record, logs.find(self.record), rank, attempt)
        return [
            RankOutput(log.attempt, log.rank, log.path, log.path.read_text(errors="replace"))
            for log in chosen
        ]

    def write_logs(
        self,
        write: Callable[[str], object],
        rank: int | None = None,
        attempt: int | None = None,
        *,
        follow: bool = False,
    ) -> int:
        """Write the output ``logs`` would return as ``hpc-elastic logs`` prints it: each log
        under an ``==> attempt N, rank R <==`` line, in attempt order, read as it is written so
        that no log is held in memory whole; with ``follow``, then new lines and new attempts
        as they come, until the job's events say it ended. Returns how many logs there were
        when it began; a rank or attempt that never ran is a ``UsageError``, as for ``logs``."""
        from hpc_elastic.ops import logs  # noqa: PLC0415

        chosen = logs.select(self.record, logs.find(self.record), rank, attempt)
        if follow:
            logs.follow(self.record, rank, attempt, write, logs.job_is_over(self.record))
        else:
            logs.show(chosen, write)
        return len(chosen)

    def cancel(self) -> list[str]:
        """End every slot and close the rendezvous; returns what was done, one phrase each."""
        from hpc_elastic.ops.cancel import cancel_job  # noqa: PLC0415

        return cancel_job(self.record)

    def wait(self, timeout: float | None = None, poll: float = WAIT_POLL_SECONDS) -> Any:
        """Block until the job ends; returns its final ``JobView``.

        Raises ``WaitTimeoutError`` (also a ``TimeoutError``) after ``timeout`` seconds; the
        job keeps running, so call ``wait`` again or ``cancel``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            view = self.status()
            if is_over(view):
                return view
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeoutError(
                    f"Job '{self.run_id}' is still {view.state} after {timeout:g} s; wait "
                    "longer, or call cancel() to end it."
                )
            _log.debug("job %s is %s; looking again in %g s", self.run_id, view.state, poll)
            left = poll if deadline is None else deadline - time.monotonic()
            time.sleep(max(0.0, min(poll, left)))


def submit(script: str | Path, *script_args: str, **options: object) -> Job:
    """Submit ``script`` (run with ``python -u`` on every rank) as an elastic job.

    ``options`` are the CLI's submit options by Python name, e.g.
    ``submit("train.py", "--lr", "3e-4", nodes="1:4", nproc_per_node=8, partition="low")``.
    Without ``zk`` (and none in the config file or ``$HPC_ELASTIC_ZK``), the job uses the
    ensemble you started with ``hpc-elastic zk start``, which must still run.
    """
    job = plan_job(script, script_args, options)
    from hpc_elastic.ensemble.choice import require_alive  # noqa: PLC0415

    require_alive(job.spec.zk)
    return send(job)


def plan_job(
    script: str | Path,
    script_args: Sequence[str] = (),
    options: Mapping[str, object] | None = None,
    *,
    config: Mapping[str, object] | None = None,
    command_line: Sequence[str] | None = None,
) -> Plan:
    """The job ``submit`` would send, script rendered; submits nothing (a dry run).

    ``config`` defaults to the config file found from the current directory.
    """
    given = {name: _as_flag_value(_option(name), value) for name, value in (options or {}).items()}
    job, _ = plan_given(
        parse_script(str(script)),
        script_args,
        given,
        given.__contains__,
        config=config,
        command_line=command_line,
    )
    return job


def plan_given(
    script: Path,
    script_args: Sequence[str],
    values: Mapping[str, object],
    given: Callable[[str], bool],
    *,
    config: Mapping[str, object] | None = None,
    command_line: Sequence[str] | None = None,
) -> tuple[Plan, ZkChoice]:
    """The plan of ``script`` from option values by name, ``given(name)`` saying which ones
    the caller gave (they beat the config file, which beats the defaults; ``values`` may hold
    the others too, as click hands them over); and the ZooKeeper it uses, with why
    (``ZkChoice.line()``, logged here). ``plan_job`` and the CLI's ``submit`` and ``render``
    plan here. ``config`` defaults to the config file found from the current directory.
    """
    config_path = None
    if config is None:
        from hpc_elastic.config import load_config  # noqa: PLC0415

        found = load_config(Path.cwd())
        config, config_path = found.values, found.path
    settings = resolve(SUBMIT_OPTIONS, values, given, config)
    flag = cast("str | None", settings["zk"]) if given("zk") else None
    zk = _zookeeper(flag, config, config_path)
    settings["zk"] = zk.address
    return plan_settings(script, script_args, settings, command_line), zk


def plan_settings(
    script: Path,
    script_args: Sequence[str],
    settings: dict[str, object],
    command_line: Sequence[str] | None = None,
) -> Plan:
    """A plan from resolved option values (``options.resolve``), ``zk`` chosen already."""
    interpreter = str(settings.pop("python") or sys.executable)
    settings["job_name"] = settings["job_name"] or default_job_name(script)
    _read_secret_files(settings)
    spec = JobSpec(script=script, script_args=tuple(script_args), **cast("Any", settings))
    line = tuple(command_line) if command_line is not None else _python_call(spec)
    from hpc_elastic.submission import plan  # noqa: PLC0415 (see the imports)

    return plan(spec, line, interpreter, datetime.now())


def send(job: Plan, files: Mapping[str, bytes] | None = None) -> Job:
    """Write the job directory (and ``files`` in it, 0600) and sbatch the planned script."""
    from hpc_elastic.slurm import commands  # noqa: PLC0415
    from hpc_elastic.submission import submit as submit_plan  # noqa: PLC0415

    submitted = submit_plan(job, commands, files)
    _log.debug("submitted %s as Slurm job %s", job.context.run_id, submitted.job_id)
    return Job(JobRecord.load(job.job_dir))


def jobs(log_dir: Path | str | None = None) -> list[Job]:
    """Your jobs, oldest first, as ``hpc-elastic list`` shows them: every job in your index
    (whatever its log directory) and under the default log directory; only those under
    ``log_dir`` when it is given."""
    from hpc_elastic.ops import jobs as found  # noqa: PLC0415

    if log_dir is not None:
        return [Job(record) for record in found.scan(Path(log_dir))]
    return [Job(record) for record in found.everywhere(found.log_dir())]


@dataclass(frozen=True)
class Listing:
    """One job as ``hpc-elastic list`` shows it."""

    job: Job
    state: str
    """What ``job.state()`` says, from the one squeue ``listing`` asked for every job."""
    summary: Any
    """What the job's events say (``hpc_elastic.ops.timeline.Summary``): when it began, its
    round and world size."""


def listing(found: Sequence[Job]) -> tuple[list[Listing], list[str]]:
    """Each job's state and what its events say, asking Slurm once for all of them (``state``
    of each job would ask once per job), and the warnings: when Slurm does not answer, the
    states are what the events say."""
    from hpc_elastic.ops import status  # noqa: PLC0415

    summaries, states, warnings = status.job_states([job.record for job in found])
    rows = [
        Listing(job, state, summary)
        for job, state, summary in zip(found, states, summaries, strict=True)
    ]
    return rows, warnings


# --- helpers ---------------------------------------------------------------------------------


def _read_secret_files(settings: dict[str, object]) -> None:
    """``env_file`` and ``notify_file`` (paths) become what they hold: variables under the
    ones ``env`` already has (a key given by ``--env`` or the config's ``env`` wins), and the
    ``notify`` URL, which must then come from nowhere else (``hpc_elastic.sensitive``)."""
    env_file = cast("Path | None", settings.pop("env_file", None))
    notify_file = cast("Path | None", settings.pop("notify_file", None))
    if env_file is None and notify_file is None:
        return
    from hpc_elastic import sensitive  # noqa: PLC0415 (only for a job that names such a file)

    if env_file is not None:
        given = dict(cast("tuple[tuple[str, str], ...]", settings.get("env") or ()))
        settings["env"] = tuple({**dict(sensitive.read_env_file(env_file)), **given}.items())
    if notify_file is not None:
        if settings.get("notify") is not None:
            raise UsageError(
                f"--notify-file '{notify_file}' and a --notify URL (from the flag, "
                f"${contract.NOTIFY_URL_ENV} or the config file) both name the webhook; give "
                "only one."
            )
        settings["notify"] = sensitive.read_notify_file(notify_file)


def _zookeeper(flag: str | None, config: Mapping[str, object], path: Path | None) -> ZkChoice:
    """``ensemble.choice.choose_zk``: the ``zk`` given, else ``$HPC_ELASTIC_ZK`` or the config
    file's, else the user's own ensemble (``hpc-elastic zk start``), else the default; which
    one is logged, as the CLI prints it."""
    from hpc_elastic.ensemble.choice import choose_zk  # noqa: PLC0415

    choice = choose_zk(flag, config, path)
    _log.info("%s", choice.line())
    return choice


def _option(name: str) -> Option:
    option = _OPTIONS.get(name)
    if option is None:
        known = ", ".join(sorted(_OPTIONS))
        raise UsageError(f"submit() has no option '{name}'; use one of {known}.")
    return option


def _as_flag_value(option: Option, value: object) -> object:
    """``value`` as click would hand the flag's value to ``resolve``: parsed by the same
    parser, and a list of texts for a repeatable option (``resolve`` parses each item)."""
    if option.repeatable:
        if isinstance(value, Mapping):  # env={"KEY": "value"}
            return [f"{key}={item}" for key, item in value.items()]
        if isinstance(value, str):
            return [value]
        if isinstance(value, Iterable):
            return [item if isinstance(item, str) else "=".join(item) for item in value]
        raise UsageError(f"submit({option.name}={value!r}) must be a list of strings.")
    if value is None or isinstance(value, bool):
        return value
    if option.parse is not None and isinstance(value, str | int | float):
        return option.parse(str(value))
    if option.type in (Path, Path | None) and isinstance(value, str | Path):
        return Path(value)
    return value


def _python_call(spec: JobSpec) -> tuple[str, ...]:
    """What the sbatch script records as the command that made it, for an API submit."""
    return ("hpc_elastic.submit", str(spec.script), *spec.script_args)
