"""The round's TCPStore, listening before any worker knocks: hosted by a warm process of the agent.

Every rank's ``init_process_group`` (``env://``) starts with a TCPStore client that connects to
``MASTER_ADDR:MASTER_PORT``. Left to the script, rank 0 opens that store itself, only once its
own ``import torch`` and whatever comes before its ``init_process_group`` are done; a rank
that knocks earlier is refused, and torch's client then sleeps before it tries again
(``ExponentialBackoffWithJitter``: 0.25 to 0.75 s, then 0.4 to 1.1 s, 0.6 to 1.7 s, ...). A
rank that imports a little faster than rank 0, or a warm rank beside a cold rank 0, pays
seconds for it, whatever the script says.

So the node that publishes a round's master port (group rank 0) has the store opened first:
a store host, started with the agent like a standby (the same interpreter, base environment
and PDEATHSIG trampoline, so the same torch as the workers), imports ``torch.distributed``
and then opens one TCPStore server per round on the agent's word; the rendezvous publishes
the port only once it listens (``Rendezvous.pick_master_port``). The node's workers get
``TORCHELASTIC_USE_AGENT_STORE=True``, with which torch makes rank 0 a client like every
other rank (``torch.distributed.rendezvous._create_c10d_store``): torchrun's own c10d
rendezvous does the same with the store it hosts in its agent. Other nodes' ranks are clients
either way. The agent itself never imports torch.

Each round gets a new server (keys of an old round, a dead rank's address, must never meet a
new one); the previous round's stays open one round longer, for survivors that leave their old
group only at their next step boundary (``--in-place``). Without a warm store host (it is still
importing, or it died) the port is a free one, as before, and rank 0's script opens it.

Every rank of the round keeps a connection to the store, an open file each in the host: 32,768
for 4,096 nodes of 8 GPUs, where many clusters let a process open 1,024 (a TCPStore server
held to 128 files took 113 of 200 clients and reset the others). So the host raises its own
limit to the hard one as it starts, says how far it got, and the agent says when a round has
more ranks than its host may hold (``short_of_files``).

The wire, one JSON object a line: the agent writes ``{"open": PORT, "host": ADDR}`` (PORT 0:
any) and ``{"keep": [PORT, ...]}``; the host answers ``{"ready": PID, "files": LIMIT}`` once, then
``{"listening": PORT}`` or ``{"error": "..."}`` and ``{"kept": [...]}``. Its own stdout and
stderr go to a log file, so that nothing torch prints can fill the pipe or be read as an answer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from hpc_elastic.contract import AGENT_ONLY_ENV, FILES_SPARE

log = logging.getLogger(__name__)

_STORE_HOST = """\
import datetime, json, os, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
files = hard if hard != resource.RLIM_INFINITY else max(soft, FILES_CAP)
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, hard))
except (ValueError, OSError):
    files = soft
answers = os.fdopen(os.dup(1), "w")
log = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
os.dup2(log, 1)
os.dup2(log, 2)
from torch.distributed import TCPStore
def say(**answer):
    answers.write(json.dumps(answer) + "\\n")
    answers.flush()
say(ready=os.getpid(), files=files)
stores = {}
for line in sys.stdin:
    order = json.loads(line)
    if "open" in order:
        try:
            store = TCPStore(order["host"], order["open"], None, True,
                             datetime.timedelta(seconds=TIMEOUT), wait_for_workers=False)
        except Exception as error:
            say(error=f"{type(error).__name__}: {error}")
            continue
        stores[store.port] = store
        say(listening=store.port)
    if "keep" in order:
        for port in [port for port in stores if port not in order["keep"]]:
            del stores[port]  # the server closes with its last reference
        say(kept=sorted(stores))
"""

FILES_CAP = 1 << 20
"""Files the host asks for where its hard limit has none (Linux's default ``nr_open``)."""

STORE_TIMEOUT = 300.0
"""Seconds the host's own client waits on its store (torch's default); it makes no request."""

ANSWER_WAIT = 5.0
"""Seconds the agent waits for the host to open a store before it publishes a free port
instead (the script's rank 0 then opens it) and kills the host (a new one starts with the next
standbys): a host that does not answer must not hold up the round for long. Opening takes
milliseconds; the margin is for a host that a loaded machine leaves without a CPU for a while,
which would otherwise lose the round its store and cost an import of torch to replace."""

OPEN_TRIES = 3
"""Ports tried when the one picked was taken meanwhile (``--master-port-range``'s race)."""


def store_host_command(python: str, log_file: Path) -> list[str]:
    """``python -c STORE_HOST LOG``: the workers' interpreter, so the workers' torch."""
    code = _STORE_HOST.replace("TIMEOUT", repr(STORE_TIMEOUT)).replace("FILES_CAP", str(FILES_CAP))
    return [python, "-c", code, str(log_file)]


def wants_store_host(command: tuple[str, ...] | list[str], prewarm: Iterable[str]) -> bool:
    """Whether to keep a store host: the workers are prewarmed with torch (the host needs the
    same torch, imported, and a node that prewarms torch pays the import ahead anyway) and are
    started by a Python interpreter we can start too."""
    roots = {module.split(".")[0] for module in prewarm}
    return "torch" in roots and Path(command[0]).name.startswith("python")


class StoreHost:
    """The agent's side: start the host, open a store for a round, keep the live ones.

    ``open`` runs on the rendezvous' thread (inside ``next_round``), the rest on the agent's;
    a lock keeps their lines apart.
    """

    def __init__(
        self,
        argv: list[str],
        env: Mapping[str, str],
        launch: Callable[[list[str], Mapping[str, str]], subprocess.Popen[bytes]],
    ) -> None:
        self._argv = argv
        # The host is no worker, but it runs the user's interpreter: no agent secret for it.
        self._env = {name: value for name, value in env.items() if name not in AGENT_ONLY_ENV}
        self._launch = launch
        self._process: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self._ready = False
        self._listening: set[int] = set()
        self._files: int | None = None
        """The host's limit of open files, as its ``ready`` said (-1: none)."""
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start a host (again, if the last one died): it imports torch in the background."""
        with self._lock:
            if self._process is not None and self._process.poll() is None:
                return
            self._buffer, self._ready, self._listening = b"", False, set()
            self._files = None
            self._process = self._launch(self._argv, self._env)
            log.debug("store host started (pid %d)", self._process.pid)

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def ready(self) -> bool:
        """Whether the host has imported torch and waits for orders (never blocks)."""
        with self._lock:
            if not self._ready and self.alive:
                self._answer(0.0)
            return self._ready and self.alive

    def open(self, host: str, pick: Callable[[], int]) -> int | None:
        """A new store listening on a port from ``pick`` (0: any), for the next round; None
        when the host is not ready or could not open one (the caller publishes a free port)."""
        with self._lock:
            if not self._ready and self.alive:
                self._answer(0.0)
            if not (self._ready and self.alive):
                log.debug("store host not ready: the round's rank 0 opens its store itself")
                return None
            for _ in range(OPEN_TRIES):
                answer = self._ask({"open": pick(), "host": host})
                if answer is None:
                    return None
                port = answer.get("listening")
                if isinstance(port, int):
                    self._listening.add(port)
                    log.debug("store host listens on port %d", port)
                    return port
                log.debug("store host could not open a store: %s", answer.get("error"))
            return None

    def short_of_files(self, ranks: int) -> str | None:
        """What to do when a store of this host cannot hold a connection from each of
        ``ranks`` ranks (None: it can, or it never said its limit)."""
        with self._lock:
            files = self._files
        if files is None or files == -1 or files >= ranks + FILES_SPARE:
            return None
        return (
            f"this node's store host may open only {files} files, but each of the round's "
            f"{ranks} ranks connects to its store, and those past the limit fail to start; "
            f"raise the limit ('ulimit -n {ranks + FILES_SPARE}' in the job's script, or ask "
            "the cluster's admin for a higher hard limit)."
        )

    def hosts(self, port: int) -> bool:
        """Whether this host's store listens on ``port`` (and the host lives)."""
        with self._lock:
            return port in self._listening and self.alive

    def keep(self, ports: Iterable[int]) -> None:
        """Close every store but those on ``ports``."""
        wanted = sorted(set(ports))
        with self._lock:
            if not (self._ready and self.alive) or set(wanted) == self._listening:
                return
            answer = self._ask({"keep": wanted})
            kept = answer.get("kept") if answer is not None else None
            if isinstance(kept, list):
                self._listening = {port for port in kept if isinstance(port, int)}

    def close(self) -> None:
        process = self._process
        if process is not None and process.returncode is None:
            # Killed before the lock is taken: an ``open`` abandoned on the rendezvous' thread
            # (a stop signal came) then reads the end of the pipe at once, and lets go of it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        with self._lock:
            process, self._process = self._process, None
            if process is None:
                return
            process.wait()
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()

    def _ask(self, order: dict[str, object]) -> dict[str, object] | None:
        """Send one order and wait ``ANSWER_WAIT`` for its answer; None if none came (the
        host is then given up: killed, so that a late answer is never read as the next one)."""
        assert self._process is not None
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(json.dumps(order).encode() + b"\n")
            self._process.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            return None
        answer = self._answer(ANSWER_WAIT)
        if answer is None:
            log.debug("store host did not answer %s within %g s; stopping it", order, ANSWER_WAIT)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._process.pid, signal.SIGKILL)
        return answer

    def _answer(self, wait: float) -> dict[str, object] | None:
        """The next answer other than ``ready`` (which only marks the host ready), within
        ``wait`` seconds; None if none came."""
        assert self._process is not None
        assert self._process.stdout is not None
        fd = self._process.stdout.fileno()
        deadline = time.monotonic() + wait
        while True:
            line, newline, rest = self._buffer.partition(b"\n")
            if newline:
                self._buffer = rest
                try:
                    answer = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(answer, dict):
                    continue
                if "ready" in answer:
                    self._ready = True
                    files = answer.get("files")
                    self._files = files if isinstance(files, int) else None
                    continue
                return answer
            left = deadline - time.monotonic()
            readable, _, _ = select.select([fd], [], [], max(left, 0.0))
            if not readable:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None  # the host died
            self._buffer += chunk
