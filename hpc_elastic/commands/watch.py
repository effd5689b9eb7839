"""``hpc-elastic watch``: the click command; ``hpc_elastic.ops.watch`` decides, this acts.

One run looks once at every job of the user's that Slurm lists and posts what it found; it is
meant to run every few minutes from scrontab (``watch --install`` writes the line) or cron.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from hpc_elastic.commands._job import log_dir_of, log_dir_option, seconds_option
from hpc_elastic.contract import NOTIFY_URL_ENV
from hpc_elastic.errors import UsageError, one_line
from hpc_elastic.jobdir import JobRecord
from hpc_elastic.ops import goodput as lost_time
from hpc_elastic.ops import jobs, status
from hpc_elastic.ops import watch as rules
from hpc_elastic.slurm import commands

if TYPE_CHECKING:
    from hpc_elastic.notify import Notifier

BEGIN = "# hpc-elastic watch: begin (written by `hpc-elastic watch --install`)"
END = "# hpc-elastic watch: end"
"""The lines around the watcher's entry in the user's scrontab, so --uninstall finds it."""


@click.command("watch")
@log_dir_option
@seconds_option(
    "--dead-after",
    "Alert when no slot of a job has run for this long.",
    default=rules.DEAD_AFTER,
)
@seconds_option(
    "--heartbeat-after",
    "Alert when a running job's heartbeat or training step has not moved for this long.",
    default=rules.HEARTBEAT_AFTER,
)
@click.option(
    "--min-goodput",
    type=float,
    default=rules.MIN_GOODPUT,
    metavar="RATIO",
    help="Alert when a job's goodput falls under this.",
)
@seconds_option(
    "--goodput-after",
    "Judge goodput only after a job has run this long.",
    default=rules.GOODPUT_AFTER,
)
@click.option(
    "--notify",
    metavar="URL",
    envvar=NOTIFY_URL_ENV,
    show_envvar=True,
    help="Where to post for a job without a --notify of its own; without any, alerts are "
    "printed (cron mails them).",
)
@click.option("--install", is_flag=True, help="Write the scrontab line that runs this watch.")
@click.option(
    "--every", type=int, default=10, metavar="MINUTES", help="With --install: how often it runs."
)
@click.option("--uninstall", is_flag=True, help="Remove the line --install wrote.")
def watch_command(
    log_dir: Path | None,
    *,
    dead_after: float,
    heartbeat_after: float,
    min_goodput: float,
    goodput_after: float,
    notify: str | None,
    install: bool,
    every: int,
    uninstall: bool,
) -> None:
    """Check every job of yours from outside: alert once when no slot runs for a while, when a
    job's heartbeat stops, or when its goodput is low, and once more when it recovers."""
    if not 0.0 <= min_goodput <= 1.0:
        raise UsageError(
            f"--min-goodput '{min_goodput}' is not a ratio; give one from 0 to 1, e.g. 0.5."
        )
    if notify is not None:
        from hpc_elastic.options import parse_notify_url  # noqa: PLC0415

        parse_notify_url(notify)
    if install or uninstall:
        _scrontab(install, every, sys.argv[1:] if install else [])
        return
    limits = rules.Thresholds(dead_after, heartbeat_after, min_goodput, goodput_after)
    sent = run_once(log_dir_of(log_dir), limits, notify, all_jobs=log_dir is None)
    click.echo(f"hpc-elastic watch: {sent} alert{'s' if sent != 1 else ''} sent.")


def run_once(
    directory: Path, limits: rules.Thresholds, notify: str | None, *, all_jobs: bool
) -> int:
    """Look at every job once, post the alerts, remember what was said."""
    records = [
        record
        for record in (jobs.everywhere(directory) if all_jobs else jobs.scan(directory))
        if not record.local and record.job_id is not None
    ]
    _, states, warnings = status.job_states(records)
    for warning in warnings:
        click.echo(f"warning: {one_line(warning)}", err=True)
    if warnings:
        return 0  # Slurm did not answer: nothing is known, nothing is said, nothing forgotten.
    ids = [job for record in records for job in record.job_ids]
    queue = commands.squeue(ids) if records else []
    now = time.time()
    seen = []
    for record, state in zip(records, states, strict=True):
        history = record.events()
        figures = lost_time.goodput(history, now=now)
        seen.append(
            rules.look_at(
                record,
                statuses=status.of_job(record, queue),
                history=history,
                state=state,
                goodput=(figures.ratio, figures.wall),
                limits=limits,
            )
        )
    path = rules.state_file()
    memory = rules.load_state(path)
    if all_jobs:
        rules.forget_unknown(memory, {record.run_id for record in records})
    notifiers: dict[str, Notifier] = {}
    sent = rules.watch(seen, memory, now, limits, _poster(notify, notifiers))
    rules.save_state(path, memory)
    for notifier in notifiers.values():
        notifier.close(10.0)
    return sent


def _poster(notify: str | None, notifiers: dict[str, Notifier]) -> rules.Post:
    """Post to the job's own ``--notify`` URL, else the watcher's; always print the alert."""
    from hpc_elastic.notify import Notifier  # noqa: PLC0415 (urllib: only when alerting)

    def post(record: JobRecord, kind: str, sentence: str) -> None:
        message = f"Job {record.run_id} (Slurm job {'/'.join(record.job_ids)}): {sentence}."
        click.echo(f"{kind}: {one_line(message)}")
        url = record.notify or notify
        if url is None:
            return
        notifier = notifiers.setdefault(url, Notifier(url))
        notifier.post(kind, message, origin=(record.run_id, ""), job_dir=str(record.job_dir))

    return post


def scrontab_text(current: str, line: str | None) -> str:
    """``current`` without the watcher's block, and with a new one for ``line`` if given."""
    kept: list[str] = []
    inside = False
    for text in current.splitlines():
        if text == BEGIN:
            inside = True
        elif text == END:
            inside = False
        elif not inside:
            kept.append(text)
    if line is not None:
        kept += [BEGIN, "#SCRON --job-name=hpc-elastic-watch --time=5", line, END]
    return "\n".join(kept) + "\n" if kept else ""


def watch_line(every: int, argv: list[str]) -> str:
    """The cron line: every ``every`` minutes, this Python runs ``watch`` with the options
    given now (but ``--install`` and ``--every``), from this directory."""
    if not 1 <= every <= 59:
        raise UsageError(
            f"--every '{every}' is not a number of minutes from 1 to 59; give e.g. 10."
        )
    options: list[str] = []
    skip = False
    for word in argv[argv.index("watch") + 1 :] if "watch" in argv else []:
        if skip:
            skip = False
            continue
        if word == "--install":
            continue
        if word == "--every":
            skip = True
            continue
        if word.startswith("--every="):
            continue
        options.append(word)
    command = [sys.executable, "-m", "hpc_elastic", "watch", *options]
    return f"*/{every} * * * * cd {shlex.quote(os.getcwd())} && {shlex.join(command)}"


def _scrontab(install: bool, every: int, argv: list[str]) -> None:
    from hpc_elastic.slurm import commands  # noqa: PLC0415

    current = commands.scrontab_read()
    line = watch_line(every, argv) if install else None
    new = scrontab_text(current, line)
    with tempfile.NamedTemporaryFile("w", prefix="hpc-elastic-scrontab-", delete=False) as file:
        file.write(new)
    try:
        commands.scrontab_write(file.name)
    finally:
        Path(file.name).unlink(missing_ok=True)
    if install:
        click.echo(f"Installed in your scrontab: {line}")
    else:
        click.echo("Removed the hpc-elastic watch line from your scrontab.")
