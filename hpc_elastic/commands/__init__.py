"""The command layer: one thin module per command, a click command and a call into the domain.

``cli`` loads each of them lazily, when it runs. The domain
sits below: ``hpc_elastic.submission``, ``hpc_elastic.local``, ``hpc_elastic.ops`` and
``hpc_elastic.doctor``; the options come from the fields that declare them, through
``hpc_elastic.options``: ``submit``'s from ``JobSpec``, ``run``'s from ``local.LocalRun``, the
checkpoint settings it shares with ``submit`` and its own ``local.RunExtras``. The agent's
command stays in ``hpc_elastic.agent.command``.

``Invocation`` lives here, not in ``submit``: ``cli`` hands one to every command, and importing
``submit`` would cost ``--help`` and every other command the whole submit path.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Invocation:
    """The raw arguments, kept so the sbatch script can record the command that made it."""

    argv: tuple[str, ...]
