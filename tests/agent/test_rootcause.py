"""Which worker errors are echoes of a peer's death (never charged to the budget)."""

from __future__ import annotations

from pathlib import Path

from hpc_elastic.agent import rootcause
from hpc_elastic.rendezvous.api import Failure


def failure(message: str, signal: str | None = None) -> Failure:
    return Failure("n", "h", 0, None if signal else 1, signal, message, 0.0)


def test_an_echo_is_the_workers_own_error_naming_a_lost_peer() -> None:
    message = (
        "Traceback (most recent call last):\n  ...\n"
        "torch.distributed.DistNetworkError: Connection reset by peer"
    )
    assert rootcause.is_echo(failure(message))


def test_a_peer_error_printed_earlier_in_the_log_tail_is_not_an_echo() -> None:
    """The tail shows a retried 'Connection refused', but the worker died of its own bug."""
    message = (
        "[W socket.cpp] Connection refused, retrying\n"
        "Traceback (most recent call last):\n"
        '  File "train.py", line 3\n'
        "ValueError: bad batch"
    )
    assert not rootcause.is_echo(failure(message))
    assert rootcause.own_error(message) == "ValueError: bad batch"


def test_a_killed_worker_is_never_an_echo() -> None:
    assert not rootcause.is_echo(failure("Connection reset by peer", signal="SIGKILL"))


def test_a_long_log_tail_never_pushes_the_agents_reason_out_of_the_message(tmp_path: Path) -> None:
    """The soak caught it: a hang's reason ("made no progress ... learned deadline") came first
    and the 2,000-character bound kept the log's end, so the reason was cut away."""
    log = tmp_path / "rank.log"
    log.write_text("".join(f"warning line {n} {'x' * 200}\n" for n in range(15)))
    reason = "Rank 2 made no progress for 60.1 s in step (learned deadline 60.0 s) and was killed."
    failure = rootcause.worker_failure(
        node_id="n",
        host="h",
        slot="0",
        rank=2,
        returncode=None,
        error_file=tmp_path / "missing.json",
        log=log,
        reason=reason,
    )
    assert failure.message.startswith(reason + "\n")
    assert failure.message.endswith("warning line 14 " + "x" * 200)
    assert len(failure.message) <= 2000
