"""submitit, for real: submit a Python function as an elastic hpc-elastic job.

submitit finds this plugin through its entry points (pyproject.toml, group ``submitit``):
``executor`` is ``HpcElasticExecutor`` and ``job_environment`` is ``HpcElasticJobEnvironment``,
both named ``hpcelastic`` (no underscore: ``AutoExecutor`` splits ``<cluster>_<param>`` at the
first one). So a submitit script switches by one line::

    executor = submitit.AutoExecutor(folder, cluster="hpcelastic")
    executor.update_parameters(nodes=4, timeout_min=60, gpus_per_node=8,
                               hpcelastic_min_nodes=1, hpcelastic_partition="low")

or ``hpc_elastic.Executor(folder).update_parameters(nodes="1:4", ...)``. Every option of the
option table is a parameter by its Python name (``partition``, ``zk``, ``nproc_per_node``, ...);
``min_nodes`` turns AutoExecutor's integer ``nodes`` into the elastic range ``min:nodes``.

The function is pickled (cloudpickle, as submitit does) into the job directory, mode 0600, and
the job is submitted through ``hpc_elastic.api`` (the sbatch script is rendered from our
templates). Every rank runs ``hpc_elastic/submitit_worker/worker.py``, which loads the pickle and
calls the function; rank 0 writes the result. On preemption the agent stops the workers with
its preemption signal, then SIGTERM; a ``submitit.helpers.Checkpointable``'s ``checkpoint()``
is then called on rank 0 and the submission it returns replaces the pickle, so the requeued
slot starts from that state.

submitit is imported only here (and by the worker through this module).
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
import types
from pathlib import Path
from typing import Any, ClassVar

import cloudpickle  # type: ignore[import-untyped]  # submitit pickles with it
from submitit.core import core, utils
from submitit.core.job_environment import JobEnvironment

from hpc_elastic import api
from hpc_elastic.contract import RUN_ID_ENV
from hpc_elastic.errors import UsageError
from hpc_elastic.jobdir import write_private_bytes
from hpc_elastic.options import SUBMIT_OPTIONS

NAME = "hpcelastic"
SUBMISSION_FILE = "submission.pkl"
RESULT_FILE = "result.pkl"
WORKER = Path(__file__).parent / "submitit_worker" / "worker.py"

_log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
"""What the agent sends a worker to stop it: the preemption signal it forwards (USR1/USR2),
then SIGTERM; the same set ``hpc_elastic.train.preemption`` listens for."""


class _ElasticPaths(utils.JobPaths):
    """submitit's paths, pointed at the job directory: the result and rank 0's latest log."""

    def __init__(self, job: api.Job) -> None:
        super().__init__(job.job_dir, job_id=job.job_id, task_id=0)
        self._job = job

    @property
    def result_pickle(self) -> Path:
        return self._job.job_dir / RESULT_FILE

    @property
    def submitted_pickle(self) -> Path:
        return self._job.job_dir / SUBMISSION_FILE

    @property
    def stdout(self) -> Path:
        logs = sorted(self._job.record.log_dir.glob("attempt_*/rank_0.log"), key=_attempt)
        return logs[-1] if logs else self._job.record.log_dir / "rank_0.log"

    @property
    def stderr(self) -> Path:
        """The agent merges each worker's stderr into its rank log."""
        return self.stdout


def _attempt(path: Path) -> int:
    return int(path.parent.name.removeprefix("attempt_"))


class ElasticJob(core.Job[Any]):
    """submitit's job handle over an hpc-elastic job: state and done come from ``api.Job``."""

    def __init__(self, folder: Path | str, job_id: str, tasks: Any = (0,)) -> None:
        self._elastic = api.Job.find(str(folder))
        super().__init__(folder, job_id, tasks)
        self._paths = _ElasticPaths(self._elastic)

    def _register_in_watcher(self) -> None:
        """No sacct watcher: the job's events and squeue say what it is doing."""

    @property
    def state(self) -> str:
        """hpc-elastic's job state, upper-cased as submitit's are: PENDING, RUNNING, ..."""
        return self._elastic.state().upper()

    def done(self, force_check: bool = False) -> bool:
        return self.paths.result_pickle.exists() or api.is_over(self._elastic.status())

    def cancel(self, check: bool = True) -> None:
        self._elastic.cancel()

    def _get_outcome_and_result(self) -> tuple[str, Any]:
        """Rank 0's pickled outcome; without one, the job's root-cause failure as the error."""
        if self.paths.result_pickle.exists():
            _check_private(self.paths.result_pickle)
            outcome: tuple[str, Any] = utils.pickle_load(self.paths.result_pickle)
            return outcome
        view = self._elastic.status()
        raise utils.UncompletedJobError(
            f"Job {self.job_id} ended {view.state} without a result; its root cause: "
            f"{view.last_failure or 'none recorded'} (logs: {self.paths.stdout})."
        )


class HpcElasticExecutor(core.Executor):
    """Submits functions as elastic hpc-elastic jobs; parameters are the option table's."""

    job_class = ElasticJob

    def __init__(self, folder: Path | str, **parameters: Any) -> None:
        super().__init__(folder)
        self.update_parameters(**parameters)

    @classmethod
    def name(cls) -> str:
        return NAME

    @classmethod
    def _valid_parameters(cls) -> set[str]:
        return {option.name for option in SUBMIT_OPTIONS} | {"min_nodes"}

    @classmethod
    def _equivalence_dict(cls) -> core.EquivalenceDict:
        return {
            "name": "job_name",
            "timeout_min": "time",
            "mem_gb": "mem",
            "nodes": "nodes",
            "cpus_per_task": "cpus_per_task",
            "gpus_per_node": "gpus_per_node",
            "tasks_per_node": "nproc_per_node",
        }

    def _convert_parameters(self, params: dict[str, Any]) -> dict[str, Any]:
        converted = super()._convert_parameters(params)
        if "mem" in converted:
            converted["mem"] = f"{round(float(converted['mem']))}G"
        return converted

    def _internal_update_parameters(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - self._valid_parameters())
        if unknown:
            raise ValueError(
                f"hpcelastic has no parameter {unknown[0]!r}; use one of "
                f"{', '.join(sorted(self._valid_parameters()))}."
            )
        self.parameters.update(kwargs)

    def submission_options(self) -> dict[str, Any]:
        """The parameters as ``api.plan_job`` options: ``min_nodes`` joins an integer ``nodes``."""
        options = dict(self.parameters)
        min_nodes = options.pop("min_nodes", None)
        if min_nodes is not None:
            options["nodes"] = f"{min_nodes}:{options.get('nodes', min_nodes)}"
        options.setdefault("log_dir", self.folder)
        options.setdefault("job_name", "submitit")
        # The worker script is ours and the user's code travels in the pickle: nothing to copy.
        options.setdefault("snapshot", False)
        return options

    def _internal_process_submissions(
        self, delayed_submissions: list[utils.DelayedSubmission]
    ) -> list[core.Job[Any]]:
        jobs: list[core.Job[Any]] = []
        for delayed in delayed_submissions:
            job = api.plan_job(WORKER, (SUBMISSION_FILE,), self.submission_options())
            pickled = cloudpickle.dumps(delayed)  # by value where submitit would, too
            submitted = api.send(job, files={SUBMISSION_FILE: pickled})
            _log.debug("submitted %s as Slurm job %s", submitted.run_id, submitted.job_id)
            jobs.append(ElasticJob(submitted.job_dir, submitted.job_id or "0"))
        return jobs

    @classmethod
    def affinity(cls) -> int:
        """Available, never chosen unless asked for by name (``cluster="hpcelastic"``)."""
        return 0


class HpcElasticJobEnvironment(JobEnvironment):
    """``submitit.JobEnvironment()`` inside a worker: rank, world size, node and job ids."""

    _env: ClassVar[dict[str, str]] = {
        "job_id": "SLURM_JOB_ID",
        "array_job_id": "SLURM_ARRAY_JOB_ID",
        "array_task_id": "SLURM_ARRAY_TASK_ID",
        "num_tasks": "WORLD_SIZE",
        "num_nodes": "GROUP_WORLD_SIZE",
        "node": "GROUP_RANK",
        "global_rank": "RANK",
        "local_rank": "LOCAL_RANK",
    }

    @classmethod
    def name(cls) -> str:
        return NAME

    @property
    def raw_job_id(self) -> str:
        """The Slurm job id, or the run id in local mode (no Slurm there)."""
        return os.environ.get("SLURM_JOB_ID") or os.environ.get(RUN_ID_ENV, "local")


def run_submission(path: Path) -> None:
    """Run the pickled submission on this rank; rank 0 writes the outcome next to it."""
    os.environ["SUBMITIT_EXECUTOR"] = NAME
    _check_private(path)
    delayed = utils.DelayedSubmission.load(path)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        on_stop = _checkpoint_on_stop(path, delayed)
        for signum in STOP_SIGNALS:
            signal.signal(signum, on_stop)
    try:
        outcome: tuple[str, Any] = ("success", delayed.result())
    except Exception:
        if rank == 0:
            _dump_private(("error", traceback.format_exc()), path.with_name(RESULT_FILE))
        raise
    if rank == 0:
        _dump_private(outcome, path.with_name(RESULT_FILE))


def _checkpoint_on_stop(path: Path, delayed: utils.DelayedSubmission) -> Any:
    """The agent stops workers with SIGTERM for preemption: a Checkpointable's ``checkpoint()``
    decides what the requeued slot runs, written over the submission (still 0600)."""

    def on_stop(signum: int, _frame: types.FrameType | None) -> None:
        for each in STOP_SIGNALS:  # the forwarded signal, then SIGTERM: checkpoint once
            signal.signal(each, signal.SIG_IGN)
        checkpointed = delayed._checkpoint_function()
        if checkpointed is not None:
            _dump_private(checkpointed, path)
            _log.debug("checkpointed the submission into %s", path)
        raise SystemExit(128 + signum)

    return on_stop


def _dump_private(value: object, path: Path) -> None:
    """Pickle ``value`` to ``path`` at once (a reader never sees half) and 0600 from birth."""
    temporary = path.with_name(f".{path.name}.tmp")
    write_private_bytes(temporary, cloudpickle.dumps(value))
    temporary.replace(path)


def _check_private(path: Path) -> None:
    """Unpickling runs code: load only the user's own file that no one else may write."""
    from hpc_elastic.config import unsafe_config_reason  # noqa: PLC0415

    info = path.stat()
    problem = unsafe_config_reason(info.st_uid, info.st_mode, os.geteuid())
    if problem is not None:
        raise UsageError(
            f"'{path}' is not loaded because {problem}; it must be your own file, mode 0600 "
            "(resubmit the job)."
        )
