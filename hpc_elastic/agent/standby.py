"""Warm standby workers: interpreters that already imported torch, waiting for a rank.

Importing torch takes about 2 s per process, 5 s for four on two cores, and a restart pays it
again for every worker: it is most of a restart's cost. With ``--prewarm torch`` the agent keeps
one standby per local worker: ``python -c STANDBY`` imports the modules, then blocks reading one
JSON line (the rank's environment and log file) from its stdin. On a restart the agent hands
each standby its rank; the standby takes the environment, points stdout/stderr at the log and
runs the script with ``runpy``, as ``python script.py`` would. Only ``python [-u] script ...``
and ``python [-u] -m module ...`` commands can be prewarmed; others start cold.

Standbys start with the same base environment as workers (so ``OMP_NUM_THREADS`` and the like
are in place before the import), through the same PDEATHSIG trampoline.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_STANDBY = """\
import importlib, json, os, runpy, sys
for name in sys.argv[1].split(","):
    importlib.import_module(name)
line = sys.stdin.readline()
if not line:
    os._exit(0)
order = json.loads(line)
os.environ.clear()
os.environ.update(order["env"])
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
if order["log"]:
    log = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
args = sys.argv[2:]
if args[0] == "-m":
    sys.argv = args[1:]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = args
    sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
    runpy.run_path(args[0], run_name="__main__")
"""

_PYTHON_FLAGS = ("-u", "-B", "-O", "-OO")

Launcher = Callable[[list[str], Mapping[str, str]], "subprocess.Popen[bytes]"]
"""Starts a process through the PDEATHSIG trampoline with a stdin pipe (workers.launch)."""


def standby_command(command: Sequence[str], modules: Sequence[str]) -> list[str] | None:
    """``python -u train.py ...`` -> ``python -u -c STANDBY torch train.py ...``; else None."""
    if not modules or not Path(command[0]).name.startswith("python"):
        return None
    flags = list(itertools.takewhile(lambda arg: arg in _PYTHON_FLAGS, command[1:]))
    rest = list(command[1 + len(flags) :])
    if not rest or (rest[0].startswith("-") and rest[0] != "-m") or rest == ["-m"]:
        return None
    return [command[0], *flags, "-c", _STANDBY, ",".join(modules), *rest]


def hand_off(process: subprocess.Popen[bytes], env: Mapping[str, str], log: Path | None) -> bool:
    """Give a standby its rank; False if it died meanwhile (then start the worker cold)."""
    if process.poll() is not None or process.stdin is None:
        return False
    order = json.dumps({"env": dict(env), "log": str(log) if log else None})
    try:
        process.stdin.write(order.encode() + b"\n")
        process.stdin.close()
    except (BrokenPipeError, ValueError):
        return False
    return True


class StandbyPool:
    """Keeps ``size`` standbys alive; ``take`` hands one out, ``close`` kills the rest."""

    def __init__(
        self,
        argv: list[str],
        env: Mapping[str, str],
        size: int,
        launch: Launcher,
    ) -> None:
        self._argv = argv
        self._env = dict(env)
        self._size = size
        self._launch = launch
        self._ready: list[subprocess.Popen[bytes]] = []

    @property
    def full(self) -> bool:
        self._ready = [process for process in self._ready if process.poll() is None]
        return len(self._ready) >= self._size

    def fill(self) -> None:
        while not self.full:
            self._ready.append(self._launch(self._argv, self._env))

    def take(self) -> subprocess.Popen[bytes] | None:
        while self._ready:
            process = self._ready.pop(0)
            if process.poll() is None:
                return process
        return None

    def close(self) -> None:
        for process in self._ready:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        self._ready.clear()
