"""``hpc-elastic logs``: every rank's output across restarts and requeues, in attempt order.

The agents write ``logs/attempt_<round>/rank_<rank>.log``; round numbers keep growing across
requeues (the rendezvous state survives them), so attempts sort into one history.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpc_elastic.errors import UsageError
from hpc_elastic.ops import timeline
from hpc_elastic.ops.jobs import JobRecord

_LOG = re.compile(r"attempt_(\d+)/rank_(\d+)\.log")
FOLLOW_INTERVAL = 0.5


@dataclass(frozen=True)
class RankLog:
    attempt: int
    rank: int
    path: Path

    @property
    def header(self) -> str:
        return f"==> attempt {self.attempt}, rank {self.rank} <=="


def find(record: JobRecord) -> list[RankLog]:
    found = []
    for path in record.log_dir.glob(record.paths.rank_logs):
        match = _LOG.search(path.as_posix())
        if match is not None:
            found.append(RankLog(int(match.group(1)), int(match.group(2)), path))
    return sorted(found, key=lambda log: (log.attempt, log.rank))


def select(
    record: JobRecord, logs: list[RankLog], rank: int | None, attempt: int | None
) -> list[RankLog]:
    """The logs asked for; asking for a rank or attempt that never ran is a usage error."""
    chosen = [
        log
        for log in logs
        if (rank is None or log.rank == rank) and (attempt is None or log.attempt == attempt)
    ]
    if chosen or not logs:
        return chosen
    if attempt is not None and all(log.attempt != attempt for log in logs):
        known = ", ".join(str(a) for a in sorted({log.attempt for log in logs}))
        raise UsageError(
            f"--attempt '{attempt}' never ran in job '{record.run_id}'; its attempts are {known}."
        )
    known = ", ".join(str(r) for r in sorted({log.rank for log in logs}))
    raise UsageError(f"--rank '{rank}' has no log in job '{record.run_id}'; its ranks are {known}.")


def show(logs: list[RankLog], write: Callable[[str], object]) -> None:
    for log in logs:
        write(log.header + "\n")
        write(log.path.read_text(errors="replace"))


def follow(
    record: JobRecord,
    rank: int | None,
    attempt: int | None,
    write: Callable[[str], object],
    keep_going: Callable[[], bool],
) -> None:
    """Print what is there, then new lines and new attempts as they come, until the job ends."""
    offsets: dict[Path, int] = {}
    current: Path | None = None
    while True:
        logs = [
            log
            for log in find(record)
            if (rank is None or log.rank == rank) and (attempt is None or log.attempt == attempt)
        ]
        for log in logs:
            with log.path.open("rb") as file:
                file.seek(offsets.get(log.path, 0))
                chunk = file.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            if not complete:
                continue
            offsets[log.path] = offsets.get(log.path, 0) + len(complete)
            if current != log.path:
                write(log.header + "\n")
                current = log.path
            write(complete.decode(errors="replace"))
        if not keep_going():
            return
        time.sleep(FOLLOW_INTERVAL)


def job_is_over(record: JobRecord) -> Callable[[], bool]:
    """For ``--follow``: stop once the events say the job succeeded or failed."""

    def going() -> bool:
        return timeline.summarize(record.events()).outcome == "running"

    return going
