"""Alerts: ``--notify URL`` posts one JSON object per event worth waking someone for.

The events: the job failed, the breaker tripped, a hang, a straggler, a slot held by Slurm
(``REQUEUE_HOLD``), the job finished. A webhook (Slack, a pager, a small relay) takes JSON.

Posting never blocks the agent: ``Notifier.post`` only puts the alert on a bounded queue, and
one background thread delivers it, retrying with exponential backoff when the receiver is
down or answers 5xx/429. When the queue is full the alert is dropped and counted, since an
agent stuck behind a dead webhook would be a worse outage than a missed message.
Only the standard library (urllib) is used, so there is no third-party boundary here.

The receiver is not trusted: whatever it answers (a reply that is not HTTP, a thousand
headers, a redirect), the delivery thread lives on, and an alert that was not delivered is
counted and reported (``on_drop``: the agent writes a ``warning`` event into the job's
timeline). No redirect is followed: urllib would follow a 302 to any host, as a GET without
the alert, so a 3xx counts as a refusal instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, MutableMapping
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

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        """Follow no redirect: returning None makes urllib raise the 3xx as an HTTPError."""

        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(request, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


DropHandler = Callable[[str, str, int], None]
"""Told of each alert not delivered: its kind, why (one phrase) and how many were dropped so
far. Called from the delivery thread or from ``post``; it must not block for long."""


@dataclass
class Notifier:
    """Delivers alerts to one URL from a daemon thread; every method returns at once."""

    url: str
    backoff: Backoff = field(default_factory=Backoff)
    timeout: float = TIMEOUT
    queue_size: int = QUEUE_SIZE
    send: Sender = _urllib_send
    on_drop: DropHandler | None = None
    """Where drops are reported besides the log (the agent sets it once it knows the job)."""
    delivered: int = 0
    dropped: int = 0
    """Alerts lost: the queue was full, every retry failed, the receiver refused or garbled
    its reply, or the agent exited first."""

    def __post_init__(self) -> None:
        check_url(self.url)
        self._host = urllib.parse.urlsplit(self.url).hostname
        """Logged instead of the URL, whose path is often the webhook's secret token."""
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(self.queue_size)
        self._closing = threading.Event()
        self._count = threading.Lock()
        """``post`` (the agent's threads) and the delivery thread both count drops."""
        self._thread = threading.Thread(target=self._deliver_all, name="notify", daemon=True)
        self._thread.start()

    def post(
        self, kind: str, message: str, *, origin: tuple[str, str] | None = None, **details: Any
    ) -> None:
        """Queue one alert (``origin``: see ``payload``); never blocks, never raises."""
        try:
            self._queue.put_nowait(payload(kind, message, origin=origin, **details))
        except queue.Full:
            self._drop(kind, "the queue of unsent alerts was full")

    def close(self, wait: float = 5.0) -> None:
        """Give each queued alert one more attempt (no retries) for up to ``wait`` seconds,
        then give up: the thread is a daemon, so a dead receiver cannot keep the agent alive.
        Alerts still queued then are counted as dropped."""
        self._closing.set()
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=wait)
        self._thread.join(wait)
        if self._thread.is_alive():
            self._drop_queued()

    def _drop_queued(self) -> None:
        while True:
            try:
                alert = self._queue.get_nowait()
            except queue.Empty:
                return
            if alert is not None:
                self._drop(str(alert["kind"]), "the agent exited before it was sent")

    def _drop(self, kind: str, why: str) -> None:
        with self._count:
            self.dropped += 1
            dropped = self.dropped
        logger.warning("notify: alert '%s' to %s dropped: %s", kind, self._host, why)
        if self.on_drop is None:
            return
        try:
            self.on_drop(kind, why, dropped)
        except Exception:  # a broken report must not stop the alerts
            logger.exception("notify: reporting the dropped alert '%s' failed", kind)

    def _deliver_all(self) -> None:
        while True:
            alert = self._queue.get()
            if alert is None:
                return
            kind = str(alert.get("kind"))
            try:
                why = self._deliver(json.dumps(alert, default=str).encode(), kind)
            except Exception as error:  # the thread must outlive any alert
                logger.exception("notify: delivering '%s' failed", kind)
                why = f"it could not be sent ({type(error).__name__})"
            if why is None:
                with self._count:
                    self.delivered += 1
            else:
                self._drop(kind, why)

    def _deliver(self, body: bytes, kind: str) -> str | None:
        """Post ``body`` with retries; None once delivered, else why it was given up."""
        why = "the agent exited before it was sent"
        for delay in [0.0, *self.backoff.delays()]:
            # While closing, a pending retry is not waited for: the agent is exiting.
            if delay and self._closing.wait(delay):
                break
            status, why, retry = self._attempt(body, kind)
            if status is not None and 200 <= status < 300:
                logger.debug("notify: %s delivered to %s", kind, self._host)
                return None
            if not retry:
                break
        return why

    def _attempt(self, body: bytes, kind: str) -> tuple[int | None, str, bool]:
        """One POST: the status (None: no valid answer), what a failure means as a phrase, and
        whether another try may pass (``worth_retrying``; never after a garbled reply).

        Anything the receiver does is an answer here, never an exception: http.client raises
        ``HTTPException`` subclasses (not ``OSError``) for a bad status line or more than 100
        headers, and those once ended the delivery thread, so every later alert was lost."""
        try:
            status = self.send(self.url, body, self.timeout)
        except OSError as error:
            logger.debug("notify: %s to %s failed: %s", kind, self._host, error)
            return None, f"{self._host} could not be reached ({type(error).__name__})", True
        except Exception as error:  # any reply at all, see above
            logger.debug("notify: %s to %s got a malformed reply: %r", kind, self._host, error)
            why = f"the reply of {self._host} was not valid HTTP ({type(error).__name__})"
            return None, why, False
        if 300 <= status < 400:
            why = f"{self._host} answered with a redirect ({status}), which is never followed"
            return status, why, False
        return status, f"{self._host} answered {status}", worth_retrying(status)


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


def from_environ(environ: MutableMapping[str, str]) -> Notifier | None:
    """The job's notifier, when ``submit --notify`` exported a URL (see ``contract``); the URL
    is taken out of ``environ``, so nothing the agent starts inherits it.

    The URL comes through the environment, never the agent's command line: a webhook's path
    is often its secret token, and every user on a node can read command lines with ``ps``,
    while a process environment is readable only by its owner. The workers never see it
    (``contract.AGENT_ONLY_ENV``): training code logs its environment more often than not.
    """
    url = environ.pop(NOTIFY_URL_ENV, None)
    return Notifier(url) if url else None


def drop_reporter(emit: Callable[..., None]) -> DropHandler:
    """A ``Notifier.on_drop`` that writes each drop as a ``warning`` event through ``emit``
    (``emit(Kind.WARNING, **details)``, as the agent writes its slot's events), so that
    ``hpc-elastic events`` shows the alerts nobody received, with their running count."""

    def report(kind: str, why: str, dropped: int) -> None:
        emit(
            Kind.WARNING,
            message=f"Alert '{kind}' was not delivered: {why}; alerts dropped so far: {dropped}.",
            alerts_dropped=dropped,
        )

    return report


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
