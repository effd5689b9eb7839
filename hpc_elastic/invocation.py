"""``AgentInvocation``: the one description of an ``hpc-elastic agent`` command line.

The sbatch templates and local mode start the same agent; both build it here, so a flag added
to the option table reaches the agent the same way under Slurm and on a laptop. ``argv()`` is
the list local mode hands to ``subprocess``; ``shell()`` is the quoted lines a template writes
between ``-m hpc_elastic agent`` and its own ``--slot`` (an array task id or a node name, which
only the shell knows). The flags are spelt by the agent's own rows (``options.AGENT_OPTIONS``),
so the agent that reads them and the code that writes them cannot disagree.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from hpc_elastic.options import agent_flag


@dataclass(frozen=True)
class AgentInvocation:
    """Who the agent is (run, job directory, node range, store) and the flags of its options."""

    python: str
    run_id: str
    job_dir: Path
    nodes: str
    """``MIN:MAX`` as the agent takes it (a fixed job of N nodes passes ``1:N``)."""
    nproc_per_node: int
    zk: str
    worker: tuple[str, ...]
    auth_file: Path | None = None
    options: tuple[tuple[str, ...], ...] = ()
    """``("--flag", "value")`` or ``("--flag",)``, in order: the option table's flags first."""

    def identity(self) -> dict[str, object]:
        """The agent options this invocation names, by the agent's row names (an unset
        ``auth_file`` passes no ``--zk-auth-file``)."""
        named: dict[str, object] = {
            "run_id": self.run_id,
            "job_dir": self.job_dir,
            "nodes": self.nodes,
            "nproc_per_node": self.nproc_per_node,
            "zk": self.zk,
            "zk_auth_file": self.auth_file,
        }
        return {name: value for name, value in named.items() if value is not None}

    def flags(self) -> list[tuple[str, ...]]:
        identity = [(agent_flag(name), str(value)) for name, value in self.identity().items()]
        return [*identity, *self.options]

    def argv(self) -> list[str]:
        """The whole command, for ``subprocess``: no shell, so nothing is quoted."""
        words = [word for flag in self.flags() for word in flag]
        return [self.python, "-m", "hpc_elastic", "agent", *words, "--", *self.worker]

    def shell(self) -> list[str]:
        """One quoted ``--flag value`` per line, for a template to put after ``agent``."""
        return [flag[0] + _quoted_value(flag) for flag in self.flags()]

    def shell_worker(self) -> str:
        return shlex.join(self.worker)


def _quoted_value(flag: tuple[str, ...]) -> str:
    return "".join(f" {shlex.quote(value)}" for value in flag[1:])
