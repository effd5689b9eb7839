"""Alerts: ``--notify URL`` posts one JSON object per event worth waking someone for.

The events: the job failed, the breaker tripped, a hang, a straggler, a slot held by Slurm
(``REQUEUE_HOLD``), the job finished. A webhook (Slack, a pager, a small relay) takes JSON.

Posting never blocks the agent: ``Notifier.post`` only puts the alert on a bounded queue, and
one background thread delivers it, retrying with exponential backoff when the receiver is
down or answers 5xx/429. When the queue is full the alert is dropped and counted, since an
agent stuck behind a dead webhook would be a worse outage than a missed message.
Only the standard library (urllib) is used, so there is no third-party boundary here.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpc_elastic.contract import NOTIFY_URL_ENV, SLOT_ENV
from hpc_elastic.errors import UsageError, one_line
from hpc_elastic.events import Event, Kind

logger = logging.getLogger(__name__)

KINDS = frozenset({"failed", "breaker", "hang", "straggler", "held", "finished"})
"""What ``--notify`` reports; other events stay in the job's timeline only."""

TIMEOUT = 10.0
"""Seconds one POST may take before it counts as a failed attempt."""
QUEUE_SIZE = 100


@dataclass(frozen=True)
class Backoff:
    """Delays before each retry: ``base * 2**n`` capped at ``cap``, at most ``retries`` times."""

    retries: int = 6
    base: float = 1.0
    cap: float = 60.0

    def delays(self) -> list[float]:
        return [min(self.cap, self.base * 2**attempt) for attempt in range(self.retries)]


def worth_retrying(status: int | None) -> bool:
    """A lost connection (None), a server error or 429 may pass; any other 4xx will not."""
    return status is None or status >= 500 or status == 429


def check_url(url: str) -> str:
    """``url`` if it is an http(s) URL with a host, else a UsageError that quotes it."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise UsageError(
            f"--notify '{one_line(url)}' is not an http(s) URL; give a webhook address such as "
            "'https://hooks.example.com/T000/B000'."
        )
    return url


def payload(
    kind: str, message: str, *, origin: tuple[str, str] | None = None, **details: Any
) -> dict[str, Any]:
    """The JSON body: what happened to which job, where and when, and one sentence.

    ``origin`` is the (job, slot) the alert is about; without it they come from the
    environment, which only the workers have (``TORCHELASTIC_RUN_ID``, ``HPC_ELASTIC_SLOT``).
    """
    job, slot = origin or (os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get(SLOT_ENV, ""))
    return {
        "kind": kind,
        "message": message,
        "job": job,
        "slot": slot,
        "node": socket.gethostname(),
        "time": time.time(),
        "details": details,
    }


Sender = Callable[[str, bytes, float], int]
"""POST ``body`` to ``url`` within ``timeout``; the HTTP status (raises OSError if no answer)."""


def _urllib_send(url: str, body: bytes, timeout: float) -> int:
    # Imported here, not at the top: urllib.request (with urllib.error, which pulls in
    # tempfile) costs every agent and every CLI command tens of milliseconds at start-up, and
    # only a job with --notify ever posts.
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


@dataclass
class Notifier:
    """Delivers alerts to one URL from a daemon thread; every method returns at once."""

    url: str
    backoff: Backoff = field(default_factory=Backoff)
    timeout: float = TIMEOUT
    queue_size: int = QUEUE_SIZE
    send: Sender = _urllib_send
    delivered: int = 0
    dropped: int = 0
    """Alerts lost: the queue was full, or every retry failed."""

    def __post_init__(self) -> None:
        check_url(self.url)
        self._host = urllib.parse.urlsplit(self.url).hostname
        """Logged instead of the URL, whose path is often the webhook's secret token."""
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(self.queue_size)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._deliver_all, name="notify", daemon=True)
        self._thread.start()

    def post(
        self, kind: str, message: str, *, origin: tuple[str, str] | None = None, **details: Any
    ) -> None:
        """Queue one alert (``origin``: see ``payload``); never blocks, never raises."""
        try:
            self._queue.put_nowait(payload(kind, message, origin=origin, **details))
        except queue.Full:
            self.dropped += 1
            logger.warning("notify: queue full, alert '%s' dropped", kind)

    def close(self, wait: float = 5.0) -> None:
        """Give each queued alert one more attempt (no retries) for up to ``wait`` seconds,
        then give up: the thread is a daemon, so a dead receiver cannot keep the agent alive."""
        self._closing.set()
        try:
            self._queue.put(None, timeout=wait)
        except queue.Full:
            return
        self._thread.join(wait)

    def _deliver_all(self) -> None:
        while True:
            alert = self._queue.get()
            if alert is None:
                return
            if self._deliver(json.dumps(alert, default=str).encode(), str(alert["kind"])):
                self.delivered += 1
            else:
                self.dropped += 1

    def _deliver(self, body: bytes, kind: str) -> bool:
        for delay in [0.0, *self.backoff.delays()]:
            # While closing, a pending retry is not waited for: the agent is exiting.
            if delay and self._closing.wait(delay):
                break
            try:
                status: int | None = self.send(self.url, body, self.timeout)
            except OSError as error:
                logger.debug("notify: %s to %s failed: %s", kind, self._host, error)
                status = None
            if status is not None and 200 <= status < 300:
                logger.debug("notify: %s delivered to %s", kind, self._host)
                return True
            if not worth_retrying(status):
                break
        logger.warning("notify: alert '%s' to %s could not be delivered", kind, self._host)
        return False


JOB_LEVEL = frozenset({"failed", "breaker", "finished"})
"""Alerts about the whole job, which every agent sees: only one agent (the leader) posts them."""


@dataclass(frozen=True)
class Alert:
    kind: str
    message: str
    details: dict[str, Any]


def alert_for(event: Event, leader: bool) -> Alert | None:
    """The alert an event deserves, if any.

    Job-level alerts come from the leader only (the wiring decides who that is, e.g. the
    agent with group rank 0), so a job on 64 nodes sends one "finished", not 64; alerts about
    one node (hang, straggler, held) come from that node's agent.
    """
    alert = _alert(event)
    if alert is None or (alert.kind in JOB_LEVEL and not leader):
        return None
    return alert


def _alert(event: Event) -> Alert | None:
    details = event.details
    job = event.job or "?"
    where = f"slot {event.slot}" if event.slot else f"node {event.node}"
    if event.kind == Kind.DONE:
        return Alert("finished", f"Job '{job}' finished.", {"round": event.round})
    if event.kind == Kind.FAILED:
        return Alert("failed", f"Job '{job}' failed: {details.get('reason', '')}", {})
    if event.kind == Kind.BREAKER:
        return Alert("breaker", str(details.get("reason", "")), dict(details))
    if event.kind == Kind.FAILURE and details.get("hung"):
        first = str(details.get("message", "")).splitlines()[:1] or ["a rank hung"]
        return Alert("hang", f"Job '{job}', {where}: {first[0]}", {"rank": details.get("rank")})
    if event.kind == Kind.STRAGGLER:
        return Alert(
            "straggler",
            f"Job '{job}', {where}: rank {details.get('rank')} steps "
            f"{float(details.get('score', 0.0)):.1f} times slower than the median.",
            dict(details),
        )
    if event.kind == Kind.HELD:
        return Alert(
            "held",
            f"Job '{job}': Slurm holds task {details.get('task')} (REQUEUE_HOLD); release it "
            "with 'scontrol release' once its node is fixed.",
            dict(details),
        )
    return None


def observer(notifier: Notifier, leader: Callable[[], bool]) -> Callable[[Event], None]:
    """An agent event observer (``Agent(on_event=...)``) that posts the alerts events deserve."""

    def observe(event: Event) -> None:
        alert = alert_for(event, leader())
        if alert is not None:
            # The event's job and slot: the agent that posts has no TORCHELASTIC_RUN_ID of its
            # own (only its workers do), so the environment would leave both empty.
            origin = (event.job, event.slot)
            notifier.post(alert.kind, alert.message, origin=origin, **alert.details)

    return observe


def from_environ(environ: Mapping[str, str]) -> Notifier | None:
    """The job's notifier, when ``submit --notify`` exported a URL (see ``contract``).

    The URL comes through the environment, never the agent's command line: a webhook's path
    is often its secret token, and every user on a node can read command lines with ``ps``,
    while a process environment is readable only by its owner.
    """
    url = environ.get(NOTIFY_URL_ENV)
    return Notifier(url) if url else None


class RankZero:
    """Whether this agent leads: it hosts global rank 0 in the latest round it started.

    Fed the agent's own events (``observe``); ``start`` lists the ranks the agent launched.
    """

    def __init__(self) -> None:
        self.leading = False

    def observe(self, event: Event) -> None:
        if event.kind == Kind.START:
            self.leading = 0 in (event.details.get("ranks") or ())

    def __call__(self) -> bool:
        return self.leading
