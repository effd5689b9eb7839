"""The rules over remembered bad nodes: expiry, the exclude list, and names we refuse; then
``hpc-elastic nodes`` and doctor's line on the in-memory book (``rendezvous/memory.py``, put
where ``zookeeper.bad_node_book`` stands, so the secret and the sentences are the real code's);
then once on the real local cluster."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from cluster import Cluster, free_port

from hpc_elastic import cli, doctor
from hpc_elastic.agent import badnodes
from hpc_elastic.agent.badnodes import (
    clear,
    current,
    exclude_list,
    expired,
    listing,
    remembered,
)
from hpc_elastic.contract import USER_SECRET_FILE_ENV
from hpc_elastic.errors import RendezvousAccessError, UsageError
from hpc_elastic.rendezvous import zookeeper
from hpc_elastic.rendezvous.badnode import BadNode
from hpc_elastic.rendezvous.memory import MemoryBadNodes
from hpc_elastic.rendezvous.secret import user_secret

REPO = Path(__file__).resolve().parents[2]


def test_a_bad_node_is_remembered_for_the_ttl_and_then_forgotten() -> None:
    record = remembered("node3", "2 uncorrectable ECC errors on GPU 1", now=100.0, ttl=50.0)
    assert current([record], now=149.0) == [record]
    assert current([record], now=150.0) == []
    assert expired([record], now=150.0) == ["node3"]


def test_of_two_records_for_one_node_the_later_expiry_wins() -> None:
    early = remembered("node3", "disk full", now=0.0, ttl=10.0)
    late = remembered("node3", "GPU missing", now=5.0, ttl=10.0)
    assert current([late, early], now=1.0) == [late]


def test_the_exclude_list_is_sorted_without_repeats_and_adds_the_current_node() -> None:
    records = [
        remembered("node9", "x", now=0.0, ttl=10.0),
        remembered("node2", "x", now=0.0, ttl=10.0),
        remembered("node5", "x", now=0.0, ttl=1.0),
    ]
    assert exclude_list(records, now=5.0, also=["node9", "node7"]) == "node2,node7,node9"


def test_a_record_survives_encoding_and_garbage_is_ignored() -> None:
    record = remembered("node1", "clock off by 40 s", now=1.0, ttl=2.0, job="llm")
    assert BadNode.decode(record.encode()) == record
    assert BadNode.decode(b"not json") is None
    assert BadNode.decode(b'{"host": "n"}') is None


@pytest.mark.parametrize("host", ["", "a/b", "..", "node\n1"])
def test_a_name_that_cannot_be_a_znode_is_refused_with_its_value_quoted(host: str) -> None:
    with pytest.raises(UsageError, match="is not a node name"):
        remembered(host, "x", now=0.0, ttl=1.0)


def test_a_ttl_that_is_not_positive_is_refused() -> None:
    with pytest.raises(UsageError, match="positive time"):
        remembered("node1", "x", now=0.0, ttl=0.0)


# --- the user's book, on the in-memory store ----------------------------------------------


def test_listing_shows_current_nodes_by_name_and_deletes_the_expired_ones() -> None:
    book = MemoryBadNodes().book("alice", "s")
    book.remember(remembered("node9", "GPU 1: 2 retired pages", now=0.0, ttl=100.0))
    book.remember(remembered("node2", "disk full", now=0.0, ttl=100.0))
    book.remember(remembered("node5", "clock off by 40 s", now=0.0, ttl=10.0))
    assert [record.host for record in listing(book, now=50.0)] == ["node2", "node9"]
    assert sorted(record.host for record in book.records()) == ["node2", "node9"]


def test_clear_forgets_the_named_nodes_and_reports_those_it_did_not_know() -> None:
    book = MemoryBadNodes().book("alice", "s")
    for host in ("node1", "node2", "node3"):
        book.remember(remembered(host, "x", now=0.0, ttl=100.0))
    cleared = clear(book, ["node3", "node7"])
    assert (cleared.forgotten, cleared.unknown) == (("node3",), ("node7",))
    assert clear(book).forgotten == ("node1", "node2")
    assert book.records() == []


def test_clear_refuses_a_name_that_cannot_be_a_node_before_forgetting_anything() -> None:
    book = MemoryBadNodes().book("alice", "s")
    book.remember(remembered("node1", "x", now=0.0, ttl=100.0))
    with pytest.raises(UsageError, match="'a/b' is not a node name"):
        clear(book, ["node1", "a/b"])
    assert [record.host for record in book.records()] == ["node1"]


def test_a_users_book_is_refused_to_another_secret_and_unreadable_records_are_skipped() -> None:
    server = MemoryBadNodes()
    server.book("alice", "hers").remember(remembered("node1", "x", now=0.0, ttl=9.0))
    server.plant("alice", "node2", b"not json")
    with pytest.raises(RendezvousAccessError, match="not guarded by user 'alice's secret"):
        server.book("alice", "mallory's")
    assert [record.host for record in server.book("alice", "hers").records()] == ["node1"]
    assert server.book("bob", "his").records() == []


def test_the_table_gives_node_since_until_with_time_left_and_reason() -> None:
    since = time.mktime((2026, 12, 1, 3, 0, 0, 0, 0, 0)) - time.timezone
    record = remembered("node017", "GPU 0: 3 uncorrectable\nECC errors", since, 3 * 3600.0)
    header, row = badnodes.table([record], now=since + 3600 + 30)
    assert header.split() == ["NODE", "SINCE", "UNTIL", "REASON"]
    assert row.startswith("node017  2026-12-01 03:00:00 UTC  2026-12-01 06:00:00 UTC (1h59m left)")
    assert row.endswith("GPU 0: 3 uncorrectable\\nECC errors")  # one line, whatever the reason
    assert badnodes.table([], now=0.0) == ["No bad nodes remembered: every node may run your jobs."]


# --- `hpc-elastic nodes` and doctor, with the in-memory book in ZooKeeper's place ----------


@pytest.fixture
def memory_zk(monkeypatch: pytest.MonkeyPatch) -> MemoryBadNodes:
    """``zookeeper.bad_node_book`` answered by an in-memory server; what it was asked is kept."""
    server = MemoryBadNodes()

    @contextlib.contextmanager
    def book(zk: str, user: str, secret: str, connect_timeout: float) -> Iterator[object]:
        assert zk == "zk1:2181", zk
        yield server.book(user, secret)

    monkeypatch.setattr(zookeeper, "bad_node_book", book)
    monkeypatch.setenv("LOGNAME", "alice")  # getpass.getuser() reads it first
    return server


def nodes(secret: Path, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(
        cli.app, ["nodes", *args, "--zk", "zk1:2181", "--user-secret-file", str(secret)]
    )
    return result.exit_code, result.stdout, result.stderr


def test_nodes_lists_the_users_bad_nodes_as_a_table_and_as_json(
    memory_zk: MemoryBadNodes, tmp_path: Path
) -> None:
    secret = tmp_path / "user-secret"
    book = memory_zk.book("alice", user_secret(secret))
    now = time.time()
    book.remember(remembered("node3", "disk full in /scratch", now, 3600.0, job="llm"))
    book.remember(remembered("node1", "old", now - 7200, 3600.0))
    code, out, err = nodes(secret)
    assert (code, err) == (0, "ZooKeeper: zk1:2181 (--zk)\n")
    lines = out.splitlines()
    assert lines[0].split() == ["NODE", "SINCE", "UNTIL", "REASON"]
    assert len(lines) == 2, out
    assert lines[1].startswith("node3 ")
    assert lines[1].endswith("disk full in /scratch")
    code, out, _ = nodes(secret, "--json")
    assert code == 0
    [shown] = json.loads(out)
    assert shown["host"] == "node3"
    assert shown["reason"] == "disk full in /scratch"
    assert shown["job"] == "llm"
    assert shown["until"] - shown["since"] == pytest.approx(3600.0)


def test_nodes_clear_forgets_some_or_all_and_says_which(
    memory_zk: MemoryBadNodes, tmp_path: Path
) -> None:
    secret = tmp_path / "user-secret"
    book = memory_zk.book("alice", user_secret(secret))
    for host in ("node1", "node2", "node3"):
        book.remember(remembered(host, "x", time.time(), 3600.0))
    code, out, _ = nodes(secret, "clear", "node2", "node9")
    assert code == 0
    assert out.splitlines() == [
        "Cleared node2: your next jobs may run there again.",
        "Not in your list: node9.",
    ]
    code, out, _ = nodes(secret, "clear", "--json")
    assert (code, json.loads(out)) == (0, {"cleared": ["node1", "node3"], "unknown": []})
    assert book.records() == []
    assert nodes(secret, "clear")[1] == "No bad nodes to clear.\n"


def test_nodes_without_the_users_secret_is_one_sentence_that_names_the_flag(
    memory_zk: MemoryBadNodes, tmp_path: Path
) -> None:
    code, out, err = nodes(tmp_path / "absent")
    assert (code, out) == (1, "")
    assert err == (
        f"error: No user secret at '{tmp_path / 'absent'}', so no agent of yours has remembered "
        "a bad node with it; if your agents use another file, give --user-secret-file FILE "
        f"(or {USER_SECRET_FILE_ENV}).\n"
    )
    assert not (tmp_path / "absent").exists(), "looking must not create a secret"


def test_nodes_with_a_secret_the_list_refuses_is_one_sentence_that_says_what_to_do(
    memory_zk: MemoryBadNodes, tmp_path: Path
) -> None:
    memory_zk.book("alice", "the secret the agents used")
    user_secret(tmp_path / "user-secret")  # a new one, as after a lost home directory
    code, _, err = nodes(tmp_path / "user-secret")
    assert code == 1
    assert err.startswith("error: ")
    assert err.count("\n") == 1
    assert "restore it" in err


def test_nodes_given_names_without_clear_is_a_usage_error_that_shows_the_command(
    memory_zk: MemoryBadNodes, tmp_path: Path
) -> None:
    code, _, err = nodes(tmp_path / "user-secret", "list", "node1")
    assert code == 2
    assert "run 'hpc-elastic nodes clear node1'" in err


def test_nodes_without_zookeeper_is_one_sentence_with_the_fix(tmp_path: Path) -> None:
    port = free_port()
    user_secret(tmp_path / "s")
    result = CliRunner().invoke(
        cli.app, ["nodes", "--zk", f"127.0.0.1:{port}", "--user-secret-file", str(tmp_path / "s")]
    )
    assert result.exit_code == 1
    assert result.stderr == (
        f"error: ZooKeeper at '127.0.0.1:{port}' did not answer within 5 s; check --zk and "
        "that the server runs.\n"
    )


def test_doctor_lists_remembered_nodes_as_a_warning_with_the_command_that_clears_them(
    memory_zk: MemoryBadNodes, tmp_path: Path
) -> None:
    secret = tmp_path / "user-secret"
    assert doctor.bad_nodes_check("zk1:2181", secret, zk_ok=True).level is doctor.Level.PASS
    memory_zk.book("alice", user_secret(secret)).remember(
        remembered("node4", "GPU 2 missing", time.time(), 600.0)
    )
    check = doctor.bad_nodes_check("zk1:2181", secret, zk_ok=True)
    assert check.level is doctor.Level.WARN
    assert check.message.startswith("1 kept out of your jobs since their health check failed:")
    assert "node4 until" in check.message
    assert check.message.endswith("(GPU 2 missing)")
    assert "hpc-elastic nodes clear NODE" in check.hint
    assert doctor.bad_nodes_check("zk1:2181", secret, zk_ok=False).level is doctor.Level.WARN


# --- on the real local cluster ------------------------------------------------------------


@pytest.mark.integration
def test_a_planted_bad_node_is_listed_by_nodes_and_doctor_and_cleared_by_nodes_clear(
    cluster: Cluster, zk_root: str, tmp_path: Path
) -> None:
    zk = f"{cluster.zk_hosts}{zk_root}"
    secret_file = Path(cluster.env[USER_SECRET_FILE_ENV])  # zk_root cleans up with it
    user = f"nodes-{uuid.uuid4().hex[:8]}"
    reason = f"GPU 0 of {cluster.nodes[0]} fell off the bus."
    record = remembered(cluster.nodes[0], reason, time.time(), 3600.0, job="planted")
    zookeeper.remember_bad_node(zk, user, user_secret(secret_file), record)
    env = {**cluster.env, "PYTHONPATH": str(REPO), "LOGNAME": user, "USER": user}

    def hpc_elastic(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hpc_elastic", *args],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    listed = hpc_elastic("nodes", "--json", f"--zk={zk}")
    assert listed.returncode == 0, listed.stderr
    assert [(shown["host"], shown["reason"]) for shown in json.loads(listed.stdout)] == [
        (cluster.nodes[0], reason)
    ]
    checked = hpc_elastic("doctor", f"--zk={zk}", f"--checkpoint-dir={tmp_path}")
    assert "! WARN  bad nodes: 1 kept out of your jobs" in checked.stdout, checked.stdout
    cleared = hpc_elastic("nodes", "clear", cluster.nodes[0], f"--zk={zk}")
    assert cleared.returncode == 0, cleared.stderr
    assert cleared.stdout.startswith(f"Cleared {cluster.nodes[0]}:")
    with zookeeper.bad_node_book(zk, user, user_secret(secret_file)) as book:
        assert listing(book, time.time()) == []
    again = hpc_elastic("nodes", f"--zk={zk}")
    assert again.stdout == "No bad nodes remembered: every node may run your jobs.\n"
