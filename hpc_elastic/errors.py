"""One exception tree, so callers catch by layer and the CLI turns any of them into one sentence.

Every message is a complete sentence that quotes the bad value and says what to do.
Third-party errors (kazoo, jinja2, subprocess) are converted at the module that owns the
library, with ``raise ... from``, so nothing above that module sees a foreign exception.
"""

from hpc_elastic.contract import UNREACHABLE_EXIT_CODE


def one_line(text: str) -> str:
    """``text`` with every unprintable character escaped (a newline as ``\\n``), so a quoted
    value cannot break an error line or end a ``#`` comment in a script."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


class HpcElasticError(Exception):
    """Root of every error this package raises on purpose."""

    exit_code: int = 1


class UsageError(HpcElasticError):
    """The user asked for something invalid: a flag, a config value, a path."""

    exit_code = 2


class ConfigError(UsageError):
    """The config file (hpc-elastic.toml or [tool.hpc-elastic]) is malformed."""


class TemplateError(UsageError):
    """An sbatch template is missing or fails to render."""


class SnapshotError(UsageError):
    """The script's project cannot be copied into the job directory (too big, unreadable)."""


class SlurmError(HpcElasticError):
    """Slurm is missing, refused a request, or answered something we cannot read."""


class RendezvousError(HpcElasticError):
    """The rendezvous store is unreachable, refused us, or holds state we cannot trust."""


class RendezvousAccessError(RendezvousError):
    """The job's rendezvous node is not guarded by the job's secret: refused, never used."""


class RendezvousUnreachableError(RendezvousError):
    """Every server of the rendezvous stayed out of reach for longer than the outage limit
    (``--zk-outage-limit``): the agent leaves the job and its slot is not requeued."""

    exit_code = UNREACHABLE_EXIT_CODE


class RendezvousClosedError(RendezvousError):
    """The job's rendezvous is closed: the job finished or was cancelled."""

    exit_code = 0


class EnsembleError(HpcElasticError):
    """The user's own ZooKeeper ensemble (``hpc-elastic zk``) cannot start, be found, be
    trusted or stop."""


class EnsembleTrustError(EnsembleError):
    """A file of the user's ensemble (the connect-string file above all) is a link, another
    user's, or writable by others: never used, never quietly replaced."""


class AgentError(HpcElasticError):
    """The node agent could not start, watch or restart its workers."""


class CheckpointError(HpcElasticError):
    """No checkpoint could be written or read back intact."""


class CheckpointFencedError(CheckpointError):
    """A writer from an older round tried to commit after a newer round began writing."""


class EventsError(HpcElasticError):
    """An event's details are not of the types its kind's readers expect: the line was not
    written by hpc-elastic (``events.read`` skips such lines)."""


class WaitTimeoutError(HpcElasticError, TimeoutError):
    """``Job.wait(timeout=...)`` ran out of time before the job ended (it keeps running)."""


class DataError(HpcElasticError):
    """The training data's position cannot be saved or resumed exactly (``hpc_elastic.train``:
    ``ElasticShards``, a stateful loader, the sample log)."""
