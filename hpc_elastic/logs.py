"""One switch for the debug logs of every module: ``HPC_ELASTIC_LOG=debug`` (or info, warning).

Every module logs through ``logging.getLogger(__name__)`` and configures nothing, so a library
user keeps control of logging. The entry points (the CLI, hence the agent command and local
mode) call ``configure_from_env`` once: the variable crosses ``sbatch`` and ``hpc-elastic run``
into every agent, so one export turns on the rendezvous decisions and phase changes of a
whole job. The records go to stderr, which is the agent's log file.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

from hpc_elastic import contract

LOG_ENV = contract.LOG_ENV
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d]: %(message)s"


def level_from_env(environ: Mapping[str, str]) -> int | None:
    """The level that ``HPC_ELASTIC_LOG`` asks for; None when unset, empty or not a level.

    An unknown value is ignored rather than refused: a typo in a debugging switch must not
    stop a training job from starting."""
    return LEVELS.get(environ.get(LOG_ENV, "").strip().lower())


def configure_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """Send the package's logs at the asked level to stderr; returns the level, or None.

    Only the ``hpc_elastic`` logger is touched, and only once (a second call finds the
    handler and changes nothing), so kazoo and torch stay as quiet as they were."""
    level = level_from_env(os.environ if environ is None else environ)
    if level is None:
        return None
    package = logging.getLogger("hpc_elastic")
    package.setLevel(level)
    if not any(isinstance(handler, _StderrHandler) for handler in package.handlers):
        handler = _StderrHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        package.addHandler(handler)
    return level


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Our own class, so a second ``configure_from_env`` can tell that the handler is there."""
