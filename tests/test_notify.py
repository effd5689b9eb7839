"""Alerts posted to a real HTTP server on 127.0.0.1: delivered, retried, never blocking."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hpc_elastic import cli
from hpc_elastic.contract import NOTIFY_URL_ENV
from hpc_elastic.errors import UsageError
from hpc_elastic.events import Event, Kind, kind_of
from hpc_elastic.notify import (
    Backoff,
    Notifier,
    RankZero,
    alert_for,
    check_url,
    from_environ,
    observer,
    worth_retrying,
)

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
