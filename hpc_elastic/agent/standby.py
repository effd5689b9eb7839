"""Warm standby workers: interpreters that already imported torch, waiting for a rank.

Importing torch takes about 2 s per process, 5 s for four on two cores, and a restart pays it
again for every worker: it is most of a restart's cost. With ``--prewarm torch`` the agent keeps
one standby per local worker: ``python -c STANDBY`` imports the modules, then blocks reading one
JSON line (the rank's environment and log file) from its stdin. On a restart the agent hands
each standby its rank; the standby takes the environment, points stdout/stderr at the log and
runs the script with ``runpy``, as ``python script.py`` would. Only ``python [-u] script ...``
and ``python [-u] -m module ...`` commands can be prewarmed; others start cold.

Standbys start with the same base environment as workers (so ``OMP_NUM_THREADS`` and the like
are in place before the import), through the same PDEATHSIG trampoline. A standby whose imports
are done creates a file named after its pid in the agent's ready directory
(``STANDBY_READY_DIR_ENV``): an agent arriving at a job that already trains waits for that
before it joins (``Agent._warm_up``), so that the running round is not stopped to wait for
this node's imports.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpc_elastic.contract import AGENT_ONLY_ENV, STANDBY_READY_DIR_ENV

_STANDBY = """\
import importlib, json, os, runpy, socket, sys, time
for name in sys.argv[1].split(","):
    importlib.import_module(name)
if os.environ.get(READY_DIR):
    open(os.path.join(os.environ[READY_DIR], str(os.getpid())), "w").close()
line = sys.stdin.readline()
if not line:
    os._exit(0)
order = json.loads(line)
os.environ.clear()
os.environ.update(order["env"])
env = order["env"]
if env.get("RANK", "0") != "0" and env.get("MASTER_PORT"):
    deadline = time.monotonic() + MASTER_WAIT
    while time.monotonic() < deadline:
        try:
            socket.create_connection((env["MASTER_ADDR"], int(env["MASTER_PORT"])), 1).close()
            break
        except (OSError, ValueError):
            time.sleep(0.01)
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
if order["log"]:
    log = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
if env.get("PYTHONFAULTHANDLER"):
    import faulthandler
    faulthandler.enable()
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
MASTER_WAIT = 3.0
"""Seconds a warm rank other than 0 waits for rank 0's store to listen before it runs the
script. torch's TCPStore client retries a refused connection only after a backoff of 0.25 to
0.75 s, then 0.4 to 1.1 s (``ExponentialBackoffWithJitter``, 500 ms x 1.5), and warm ranks
start so close together that the clients often knock before rank 0 has opened its port. A
plain connect every 10 ms costs nothing. Only scripts that call ``init_process_group``
themselves wait (``starts_process_group``), and the bound keeps one that starts it late from
waiting long."""
_MAX_SCANNED = 200
"""Local files ``_read_code`` reads at most: past that, ``may_import`` gives up and says yes."""
_CALLED_IMPORTS = {
    "use_deterministic_algorithms": "torch._inductor.config",
    "torch.compile": "torch._inductor.config",
    "optim": "torch._dynamo",
}
"""Calls that import a large module the first time they run, and the module a standby imports
ahead of them (``warm_modules``). ``torch.use_deterministic_algorithms`` sets
``torch._inductor.config.deterministic``, and importing that runs ``torch._inductor`` and with
it ``torch._dynamo`` and ``sympy``: 1.4 to 1.7 s more on top of ``import torch`` here, 5 s per
worker when four start together on two loaded cores. ``examples/train.py`` calls it at its
first line, so warm workers still paid it after the hand-over: 11 s of a 14 s restart on the
local cluster (``bench/standby_bench.py``; docs/benchmarks.md, "Warm workers"). ``torch.compile``
imports the same two packages. It costs a standby 70 MB more, so only scripts that name the
call pay it. The first optimizer a process builds (``torch.optim``: its methods are wrapped
to be skipped by dynamo) imports ``torch._dynamo``: 2.5 s for one process here, unloaded, and
most of the 4-5 s an in-place replacement took to join the survivors in the side-by-side
benchmark (``bench/agent_bench.py --side-by-side``); any script that says "optim" gets it warm."""

log = logging.getLogger(__name__)

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
    wait = MASTER_WAIT if starts_process_group(command) else 0.0
    code = _STANDBY.replace("MASTER_WAIT", f"{wait!r}").replace(
        "READY_DIR", repr(STANDBY_READY_DIR_ENV)
    )
    warm = warm_modules(command, modules)
    return [command[0], *flags, "-c", code, ",".join(warm), *rest]


def warm_modules(command: Sequence[str], modules: Sequence[str]) -> list[str]:
    """``modules``, then the modules that calls named by the script (or a local module it
    imports) import when they first run (``_CALLED_IMPORTS``), for the prewarmed packages only:
    a standby that imported torch but not ``torch._inductor`` hands over a worker that imports
    it anyway, after the restart began.
    """
    roots = {module.split(".")[0] for module in modules}
    candidates = {
        call: module for call, module in _CALLED_IMPORTS.items() if module.split(".")[0] in roots
    }
    extra = [candidates[call] for call in sorted(_named_in_code(command, set(candidates)))]
    warm = list(dict.fromkeys([*modules, *extra]))
    if len(warm) > len(modules):
        log.debug("the script calls what imports %s: standbys import it too", warm[len(modules) :])
    return warm


def starts_process_group(command: Sequence[str]) -> bool:
    """Whether the script, or a local module it imports, names ``init_process_group``: only
    then is rank 0's store sure to open, so that warm ranks wait for it (``MASTER_WAIT``). A
    script whose framework starts the group does not wait and keeps torch's own backoff."""
    return bool(_named_in_code(command, {"init_process_group"}))


def _named_in_code(command: Sequence[str], words: set[str]) -> set[str]:
    """Which of ``words`` the script, or a local module it imports, contains as text (a cheap
    look: a comment counts too, and that only costs a warm import). Other files beside it do
    not count: a folder of scripts (train.py, eval.py, ...) is common, and one that builds an
    optimizer would give every other one's standbys ``torch._dynamo`` (2.4 s more each)."""
    script = _script(command)
    if script is None or not words:
        return set()
    found: set[str] = set()
    for text in _read_code(script).texts:
        found |= {word for word in words if word in text}
    return found


def _script(command: Sequence[str]) -> Path | None:
    """The script of ``python [flags] SCRIPT ...``; None for ``-m`` and the like."""
    flags = list(itertools.takewhile(lambda arg: arg in _PYTHON_FLAGS, command[1:]))
    rest = list(command[1 + len(flags) :])
    if not rest or rest[0].startswith("-"):
        return None
    return Path(rest[0])


@dataclass
class _Code:
    """The script and the local modules it imports, transitively, as ``python script.py``
    would find them (``_read_code``)."""

    texts: list[str] = field(default_factory=list)
    """The source of every file read."""
    outside: list[tuple[Path, str]] = field(default_factory=list)
    """(file, module) of every import that is not a local module: the standard library,
    third-party packages, or a relative import not found."""
    complete: bool = True
    """False when a file could not be read or parsed, or there were over ``_MAX_SCANNED``."""


def _read_code(script: Path) -> _Code:
    """Read the script and follow its local imports with ``ast``; nothing is run."""
    code = _Code()
    pending, seen = [script], set[Path]()
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        if len(seen) > _MAX_SCANNED:
            code.complete = False
            break
        try:
            source = path.read_bytes()
            code.texts.append(source.decode(errors="replace"))
            tree = ast.parse(source, filename=str(path))
        except (OSError, SyntaxError, ValueError):
            code.complete = False
            continue
        for name in _imported(tree):
            local = _local_module(script.parent, path.parent, name)
            if local is not None:
                pending.append(local)
            else:
                code.outside.append((path, name))
    return code


def may_import(command: Sequence[str], modules: Sequence[str]) -> bool:
    """Whether the script of ``python SCRIPT ...`` may import one of ``modules``; False only
    when every import of the script and of its local modules is visible and none is.

    A standby that imports torch for a script that never does costs 2 s of a core per worker
    and makes the first start wait (32 of them took a minute on two cores). The imports are read
    with ``ast``, never run. Whatever cannot be seen through counts as a yes: a third-party
    package (it may import torch), ``python -m``, a file that does not parse.
    """
    script = _script(command)
    if script is None:
        return True
    code = _read_code(script)
    if not code.complete:
        return True
    wanted = {module.split(".")[0] for module in modules}
    for path, name in code.outside:
        if name.lstrip(".").split(".")[0] in wanted:
            log.debug("%s imports %s: standbys prewarm it", path, name)
            return True
        if name.startswith(".") or name.split(".")[0] not in _STDLIB:
            return True  # Third-party (or a relative import not found): it may import it.
    log.debug("%s imports none of %s: no standbys", script, ", ".join(sorted(wanted)))
    return False


_STDLIB = sys.stdlib_module_names | {"__future__", "__main__"}


def _imported(tree: ast.AST) -> list[str]:
    """Every module an ``import`` may load, anywhere in the file (lazy imports count):
    ``from a import b`` names ``a`` and ``a.b`` (``b`` may be a submodule); relative imports
    keep their leading dots."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            if base:
                names.append(base)
            joiner = "" if base.endswith(".") or not base else "."
            names.extend(f"{base}{joiner}{alias.name}" for alias in node.names)
    return names


def _local_module(root: Path, here: Path, name: str) -> Path | None:
    """The file of the longest prefix of ``name`` that is a module next to the script (as
    ``python script.py`` finds it) or, for a relative import, next to the importing file."""
    level = len(name) - len(name.lstrip("."))
    base = root if level == 0 else here.parents[level - 2] if level > 1 else here
    parts = [part for part in name.lstrip(".").split(".") if part]
    for end in range(len(parts), 0 if level == 0 else -1, -1):
        stem = base.joinpath(*parts[:end])
        for candidate in (stem / "__init__.py", stem.with_suffix(".py") if end else None):
            if candidate is not None and candidate.is_file():
                return candidate
    return None


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
    """Keeps ``size`` standbys alive; ``take`` hands one out, ``close`` kills the rest.

    Each standby marks ``ready_dir`` (a file named after its pid) once its imports are done:
    ``warm`` says whether every live one has.
    """

    def __init__(
        self,
        argv: list[str],
        env: Mapping[str, str],
        size: int,
        launch: Launcher,
        ready_dir: Path,
    ) -> None:
        self._argv = argv
        # A standby becomes a worker: it never gets what only the agent may know.
        self._env = {name: value for name, value in env.items() if name not in AGENT_ONLY_ENV}
        self._env[STANDBY_READY_DIR_ENV] = str(ready_dir)
        self._size = size
        self._launch = launch
        self._ready_dir = ready_dir
        self._ready: list[subprocess.Popen[bytes]] = []

    @property
    def full(self) -> bool:
        self._drop_dead()
        return len(self._ready) >= self._size

    @property
    def warm(self) -> bool:
        """Whether every live standby has imported its modules (a dead one never will; its
        rank starts cold)."""
        self._drop_dead()
        return all(self._marker(process).exists() for process in self._ready)

    def fill(self) -> None:
        self._ready_dir.mkdir(parents=True, exist_ok=True)
        while not self.full:
            self._ready.append(self._launch(self._argv, self._env))

    def take(self) -> subprocess.Popen[bytes] | None:
        while self._ready:
            process = self._ready.pop(0)
            self._marker(process).unlink(missing_ok=True)  # its pid may name a new one later
            if process.poll() is None:
                return process
        return None

    def close(self) -> None:
        for process in self._ready:
            if process.returncode is None:  # Reaped, its pid may name another group now.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            self._marker(process).unlink(missing_ok=True)
        self._ready.clear()

    def _drop_dead(self) -> None:
        for process in [process for process in self._ready if process.poll() is not None]:
            self._ready.remove(process)
            self._marker(process).unlink(missing_ok=True)  # its pid may name a new one later

    def _marker(self, process: subprocess.Popen[bytes]) -> Path:
        return self._ready_dir / str(process.pid)
