"""Alerts posted to a real HTTP server on 127.0.0.1: delivered, retried, never blocking; and
receivers that misbehave (malformed replies from a raw socket server, a redirect to another
host), none of which stops the alerts, loses one uncounted or sends one elsewhere."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as hs
from test_agent import Cluster as AgentCluster

from hpc_elastic import cli, events
from hpc_elastic.agent.api import ExitCode
from hpc_elastic.contract import NOTIFY_URL_ENV
from hpc_elastic.errors import UsageError
from hpc_elastic.events import Event, Kind, kind_of
from hpc_elastic.notify import (
    Backoff,
    Notifier,
    RankZero,
    alert_for,
    check_url,
    drop_reporter,
    from_environ,
    observer,
    worth_retrying,
)
from hpc_elastic.ops.timeline import describe

DEADLINE = 30.0
FAST = Backoff(retries=4, base=0.01, cap=0.05)


class Receiver(ThreadingHTTPServer):
    """Answers each POST with the next status in ``statuses`` (200 once they run out);
    with ``hold`` set, every request waits for ``release`` before it is answered."""

    daemon_threads = True

    def __init__(self, statuses: list[int], hold: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.statuses = statuses
        self.hold = hold
        self.release = threading.Event()
        self.attempts: list[dict[str, Any]] = []
        self.arrived = threading.Condition()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook/SECRET"

    def wait_for(self, attempts: int) -> list[dict[str, Any]]:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.attempts) >= attempts, DEADLINE), (
                f"only {len(self.attempts)} of {attempts} attempts arrived"
            )
            return list(self.attempts)


class Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.arrived:
            self.server.attempts.append(body)
            status = self.server.statuses.pop(0) if self.server.statuses else 200
            self.server.arrived.notify_all()
        if self.server.hold:
            self.server.release.wait(DEADLINE)
        self.send_response(status)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(statuses: list[int], hold: bool = False) -> Iterator[Receiver]:
    server = Receiver(statuses, hold)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    yield from serve([])


@pytest.fixture
def flaky() -> Iterator[Receiver]:
    yield from serve([500, 503])


@pytest.fixture
def stuck() -> Iterator[Receiver]:
    yield from serve([], hold=True)


def wait_until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_an_alert_arrives_as_json_with_the_job_and_the_sentence(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "llm-7b")
    monkeypatch.setenv("HPC_ELASTIC_SLOT", "3")
    notifier = Notifier(receiver.url, backoff=FAST)
    notifier.post("hang", "Rank 5 made no progress for 312.0 s and was killed.", rank=5)
    [body] = receiver.wait_for(1)
    assert body["kind"] == "hang"
    assert body["message"] == "Rank 5 made no progress for 312.0 s and was killed."
    assert (body["job"], body["slot"], body["details"]) == ("llm-7b", "3", {"rank": 5})
    wait_until(lambda: notifier.delivered == 1, "the delivery was not counted")
    notifier.close()


def test_a_receiver_that_fails_twice_gets_the_alert_on_the_third_try(flaky: Receiver) -> None:
    notifier = Notifier(flaky.url, backoff=FAST)
    notifier.post("finished", "The job finished.")
    attempts = flaky.wait_for(3)
    assert [body["kind"] for body in attempts] == ["finished"] * 3
    wait_until(lambda: notifier.delivered == 1, "the third try was not counted as delivered")
    assert notifier.dropped == 0
    notifier.close()


def test_a_refused_alert_is_not_retried(receiver: Receiver) -> None:
    receiver.statuses[:] = [404]
    notifier = Notifier(receiver.url, backoff=FAST)
    notifier.post("failed", "The job failed.")
    receiver.wait_for(1)
    wait_until(lambda: notifier.dropped == 1, "a 404 was not given up on")
    assert len(receiver.attempts) == 1
    notifier.close()


def test_a_receiver_that_never_answers_never_blocks_the_agent(stuck: Receiver) -> None:
    """If ``post`` or ``close`` blocked on the receiver, the receiver would never be released
    and this test would hang until pytest's timeout: returning at all is the assertion."""
    notifier = Notifier(stuck.url, backoff=FAST, timeout=DEADLINE, queue_size=2)
    for number in range(5):
        notifier.post("straggler", f"Rank {number} is slow.")
    stuck.wait_for(1)
    assert notifier.dropped >= 2  # a full queue drops, it does not wait
    notifier.close(wait=0.0)
    stuck.release.set()


def test_an_unreachable_receiver_is_retried_then_given_up_and_counted() -> None:
    attempts: list[str] = []

    def refuse(url: str, body: bytes, timeout: float) -> int:
        attempts.append(url)
        raise ConnectionRefusedError("Connection refused")

    notifier = Notifier("http://127.0.0.1:9/hook", backoff=FAST, send=refuse)
    notifier.post("held", "Slot 2 is held by Slurm (REQUEUE_HOLD).")
    wait_until(lambda: notifier.dropped == 1, "the alert was never given up on")
    assert len(attempts) == 1 + FAST.retries
    notifier.close()


def test_backoff_doubles_up_to_its_cap() -> None:
    assert Backoff(retries=5, base=1.0, cap=5.0).delays() == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_only_lost_connections_server_errors_and_429_are_retried() -> None:
    assert worth_retrying(None)
    assert worth_retrying(502)
    assert worth_retrying(429)
    assert not worth_retrying(400)
    assert not worth_retrying(403)


@pytest.mark.parametrize("url", ["hooks.example.com/x", "ftp://host/x", "http://", "file:///etc"])
def test_a_url_that_is_not_http_is_refused_with_its_value_quoted(url: str) -> None:
    with pytest.raises(UsageError, match="is not an http"):
        check_url(url)


def event(kind: str, **details: Any) -> Event:
    return Event(kind=kind_of(kind), job="llm", slot="4", node="n4", round=7, details=details)


@pytest.mark.parametrize(
    ("source", "kind", "message"),
    [
        (event("done"), "finished", "Job 'llm' finished."),
        (event("failed", reason="no nodes left"), "failed", "Job 'llm' failed: no nodes left"),
        (
            event(
                "breaker",
                reason="The job restarted 5 times since step 1200 without progress; fix ...",
            ),
            "breaker",
            "The job restarted 5 times since step 1200 without progress; fix ...",
        ),
        (
            event(
                "failure", hung=True, rank=3, message='Rank 3 made no progress.\n  File "train.py"'
            ),
            "hang",
            "Job 'llm', slot 4: Rank 3 made no progress.",
        ),
        (
            event("straggler", rank=5, score=2.54),
            "straggler",
            "Job 'llm', slot 4: rank 5 steps 2.5 times slower than the median.",
        ),
        (
            event("held", task=9),
            "held",
            "Job 'llm': Slurm holds task 9 (REQUEUE_HOLD); release it with 'scontrol release' "
            "once its node is fixed.",
        ),
    ],
)
def test_each_alerting_event_becomes_one_alert_with_a_sentence(
    source: Event, kind: str, message: str
) -> None:
    alert = alert_for(source, leader=True)
    assert alert is not None
    assert (alert.kind, alert.message) == (kind, message)


def test_job_level_alerts_come_from_the_leader_only_node_alerts_from_every_node() -> None:
    assert alert_for(event("done"), leader=False) is None
    assert alert_for(event("failed", reason="x"), leader=False) is None
    assert alert_for(event("straggler", rank=1, score=2.0), leader=False) is not None
    assert alert_for(event("failure", hung=True, rank=1, message="m"), leader=False) is not None


def test_ordinary_events_and_plain_failures_raise_no_alert() -> None:
    for quiet in (event("round"), event("restart"), event("failure", hung=False, rank=0)):
        assert alert_for(quiet, leader=True) is None


def test_the_observer_posts_what_the_agent_reports(receiver: Receiver) -> None:
    notifier = Notifier(receiver.url, backoff=FAST)
    observe = observer(notifier, leader=lambda: True)
    observe(event("round"))
    observe(event("done"))
    [body] = receiver.wait_for(1)
    assert (body["kind"], body["message"]) == ("finished", "Job 'llm' finished.")
    notifier.close()


# --- the option table's side: --notify reaches the agent through the job's environment ---

cli_runner = CliRunner()


def test_the_agent_finds_the_hook_in_its_environment_only() -> None:
    assert from_environ({}) is None
    notifier = from_environ({NOTIFY_URL_ENV: "https://hooks.example.com/x"})
    assert notifier is not None
    notifier.close()


def test_the_agent_hosting_rank_0_of_the_latest_round_leads() -> None:
    leader = RankZero()
    assert not leader()
    leader.observe(Event(kind=Kind.START, details={"ranks": [0, 1]}))
    assert leader()
    leader.observe(Event(kind=Kind.START, details={"ranks": [2, 3]}))
    assert not leader()


def test_notify_reaches_the_job_as_an_exported_variable_not_a_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    url = "https://hooks.example.com/T0/B0?token=s3cret"
    result = cli_runner.invoke(cli.app, ["render", "--notify", url, "train.py"])
    assert result.exit_code == 0, result.stderr
    assert f"export {NOTIFY_URL_ENV}='{url}'\n" in result.stdout
    flags = [line for line in result.stdout.splitlines() if line.lstrip().startswith("--")]
    assert flags  # the agent's flags, one per line
    assert not any("s3cret" in line for line in flags)  # `ps` on the node shows those


def test_notify_comes_from_the_config_file_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "hpc-elastic.toml").write_text('notify = "http://alerts.local/hook"\n')
    result = cli_runner.invoke(cli.app, ["render", "train.py"])
    assert result.exit_code == 0, result.stderr
    assert f"export {NOTIFY_URL_ENV}=http://alerts.local/hook\n" in result.stdout


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://x/y", "https://", "http://a b"])
def test_a_url_that_is_not_a_web_hook_is_one_usage_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    result = cli_runner.invoke(cli.app, ["render", "--notify", url, "train.py"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --notify ")
    assert result.stderr.count("\n") == 1


# --- a hostile receiver: malformed replies, redirects -----------------------------------------

OK_REPLY = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
BAD_STATUS_LINE = b"I am not HTTP at all\r\n\r\n"
TOO_MANY_HEADERS = (
    b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-H%d: v\r\n" % n for n in range(101)) + b"\r\n"
)


class RawReceiver:
    """A TCP server on 127.0.0.1 that reads each HTTP request whole and answers it with raw
    bytes: the next of ``replies``, then ``OK_REPLY``; what an http.server cannot be made to
    send (a bad status line, 101 headers) is what this one is for."""

    def __init__(self, replies: list[bytes]) -> None:
        self.replies = replies
        self.bodies: list[dict[str, Any]] = []
        self.arrived = threading.Condition()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/hook/SECRET"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return  # closed at the end of the test
            with connection:
                body = self._read_request(connection)
                with self.arrived:
                    reply = self.replies.pop(0) if self.replies else OK_REPLY
                    self.bodies.append(json.loads(body) if body else {})
                    self.arrived.notify_all()
                with contextlib.suppress(OSError):
                    connection.sendall(reply)

    @staticmethod
    def _read_request(connection: socket.socket) -> bytes:
        connection.settimeout(DEADLINE)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = connection.recv(65536)
            if not chunk:
                return b""
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        while len(body) < length:
            body += connection.recv(65536)
        return body

    def wait_for(self, count: int) -> list[dict[str, Any]]:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.bodies) >= count, DEADLINE), (
                f"only {len(self.bodies)} of {count} requests arrived"
            )
            return list(self.bodies)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def raw() -> Iterator[RawReceiver]:
    server = RawReceiver([])
    yield server
    server.close()


class Drops:
    """A ``Notifier.on_drop`` that keeps what it was told."""

    def __init__(self) -> None:
        self.told: list[tuple[str, str, int]] = []

    def __call__(self, kind: str, why: str, dropped: int) -> None:
        self.told.append((kind, why, dropped))


def test_malformed_replies_never_stop_the_alerts_and_each_drop_is_counted_and_reported(
    raw: RawReceiver,
) -> None:
    """A bad status line and 101 headers made http.client raise what the delivery thread did
    not catch: it died, and every later alert was lost without being counted."""
    raw.replies[:] = [BAD_STATUS_LINE, TOO_MANY_HEADERS]
    notifier = Notifier(raw.url, backoff=FAST)
    drops = Drops()
    notifier.on_drop = drops
    for kind in ("hang", "straggler", "finished"):
        notifier.post(kind, f"a {kind} alert")
    assert [body["kind"] for body in raw.wait_for(3)] == ["hang", "straggler", "finished"]
    wait_until(lambda: notifier.delivered == 1, "the alert after two malformed replies was lost")
    assert notifier.dropped == 2
    assert [(kind, count) for kind, _, count in drops.told] == [("hang", 1), ("straggler", 2)]
    assert all("was not valid HTTP" in why for _, why, _ in drops.told), drops.told
    assert not any("SECRET" in why for _, why, _ in drops.told)  # the URL's path is a secret
    notifier.close()


@settings(max_examples=25, deadline=None)
@given(reply=hs.binary(max_size=300) | hs.sampled_from([BAD_STATUS_LINE, TOO_MANY_HEADERS]))
def test_after_any_reply_at_all_the_next_alert_is_still_delivered(reply: bytes) -> None:
    server = RawReceiver([reply])
    notifier = Notifier(server.url, backoff=FAST)
    try:
        notifier.post("hang", "first")
        wait_until(
            lambda: notifier.delivered + notifier.dropped == 1, "the first alert was not counted"
        )
        notifier.post("finished", "second")
        wait_until(
            lambda: notifier.delivered + notifier.dropped == 2, "the second alert was not counted"
        )
        assert server.bodies[-1]["kind"] == "finished"
        assert notifier.delivered >= 1  # the second one met a good reply
    finally:
        notifier.close()
        server.close()


class Recorder(BaseHTTPRequestHandler):
    """Records every request of any method; a stolen alert would arrive here."""

    server: Stolen

    def _record(self) -> None:
        self.server.requests.append((self.command, self.path))
        self.send_response(200)
        self.end_headers()

    do_GET = do_POST = do_PUT = _record

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Stolen(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Recorder)
        self.requests: list[tuple[str, str]] = []


class Redirector(BaseHTTPRequestHandler):
    """Answers every POST with a 302 to another host (``localhost``, not ``127.0.0.1``)."""

    server: Redirecting

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.posts += 1
        self.send_response(302)
        self.send_header("Location", self.server.target)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Redirecting(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, target: str) -> None:
        super().__init__(("127.0.0.1", 0), Redirector)
        self.target = target
        self.posts = 0


def running(server: ThreadingHTTPServer) -> Iterator[None]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield
    server.shutdown()
    server.server_close()
    thread.join()


def test_a_redirect_to_another_host_is_never_followed_and_the_alert_counts_as_dropped() -> None:
    stolen = Stolen()
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.contextmanager(running)(stolen))
        target = f"http://localhost:{stolen.server_address[1]}/collect"
        redirecting = Redirecting(target)
        stack.enter_context(contextlib.contextmanager(running)(redirecting))
        notifier = Notifier(f"http://127.0.0.1:{redirecting.server_address[1]}/hook", backoff=FAST)
        drops = Drops()
        notifier.on_drop = drops
        notifier.post("failed", "The job failed.")
        # The redirect would be followed within the one POST that got the 302, before the
        # drop is counted: once it is counted, nothing can reach the other host any more.
        wait_until(lambda: notifier.dropped == 1, "the redirected alert was not counted")
        assert stolen.requests == []
        assert redirecting.posts == 1  # a redirect is an answer: no retries either
        assert "redirect (302)" in drops.told[0][1]
        notifier.close()


def test_each_drop_becomes_a_warning_in_the_jobs_timeline(
    receiver: Receiver, tmp_path: Path
) -> None:
    events_file = tmp_path / "events.jsonl"

    def emit(kind: Kind, **details: object) -> None:
        events.append(events_file, Event(kind=kind, job="llm", slot="2", details=dict(details)))

    receiver.statuses[:] = [404]
    notifier = Notifier(receiver.url, backoff=FAST, on_drop=drop_reporter(emit))
    notifier.post("finished", "The job finished.")
    wait_until(lambda: list(events.read(events_file)), "the drop never reached the timeline")
    [warning] = list(events.read(events_file))
    assert warning.kind == Kind.WARNING
    assert warning.details["alerts_dropped"] == 1
    line = describe(warning)
    assert "Alert 'finished' was not delivered: 127.0.0.1 answered 404" in line
    assert "SECRET" not in line
    notifier.close()


def test_the_agent_takes_the_hook_out_of_its_environment() -> None:
    environ = {NOTIFY_URL_ENV: "https://hooks.example.com/T0/B0/SECRET", "PATH": "/bin"}
    notifier = from_environ(environ)
    assert notifier is not None
    assert environ == {"PATH": "/bin"}  # so nothing the agent starts inherits it
    notifier.close()


def test_the_hook_never_reaches_the_workers_environment(tmp_path: Path) -> None:
    """Training code logs its environment (trackers upload it): the URL stays with the agent."""
    cluster = AgentCluster(tmp_path, nodes="1")
    cluster.start(1, **{NOTIFY_URL_ENV: "https://hooks.example.com/T0/B0/SECRET"})
    assert cluster.join() == {0: ExitCode.SUCCESS}
    [env] = cluster.envs(1).values()
    assert env["RANK"] == "0"  # the worker's own environment, as it saw it
    assert NOTIFY_URL_ENV not in env
    assert not any("SECRET" in value for value in env.values())
