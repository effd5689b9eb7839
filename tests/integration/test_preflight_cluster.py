"""The health preflight on the real local Slurm + ZooKeeper: a node the user remembers as bad
is never joined, and its slot requeues away from every remembered bad node. The job has two
slots, so Slurm starts both on bad nodes (it fills n1, n2 first); the one that lands on the
last node finishes the job, and the other is cancelled with it."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from cluster import Cluster, wait_until
from submit_output import submitted

from hpc_elastic import events
from hpc_elastic.agent.badnodes import clear, remembered
from hpc_elastic.rendezvous import zookeeper
from hpc_elastic.rendezvous.secret import user_secret

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FINISHES = "print('trained')\n"


def test_a_slot_never_joins_on_a_remembered_bad_node_and_finishes_on_a_good_one(
    cluster: Cluster, tmp_path: Path
) -> None:
    secret_file = tmp_path / "user-secret"
    *bad, good = cluster.nodes
    # The agents' user (getpass reads $LOGNAME first): one of this test's own, so its node
    # under '@users' is guarded by this test's secret whatever other tests made before.
    user = f"preflight-{uuid.uuid4().hex[:8]}"
    for node in bad:
        record = remembered(node, f"GPU 0 of {node} fell off the bus.", time.time(), 3600.0)
        zookeeper.remember_bad_node(cluster.zk_hosts, user, user_secret(secret_file), record)
    script = tmp_path / "finish.py"
    script.write_text(FINISHES)
    result = subprocess.run(
        [
            sys.executable, "-m", "hpc_elastic", "submit", "--nodes=1:2", "--partition=low",
            f"--zk={cluster.zk_hosts}", "--no-prewarm",
            f"--env=HPC_ELASTIC_USER_SECRET_FILE={secret_file}", f"--env=LOGNAME={user}",
            f"--env=USER={user}", str(script),
        ],
        cwd=tmp_path, env={**cluster.env, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    _, job_dir = submitted(result.stdout)
    history = job_dir / "events.jsonl"

    def said(kind: str) -> list[events.Event]:
        return [event for event in events.read(history) if event.kind == kind]

    def started_again() -> bool:
        # Skip Slurm's requeue delay: safe, as the task is excluded from the node it left.
        for requeue in said("requeue"):
            moved = requeue.details["slurm_job"]
            cluster.run(["scontrol", "update", f"JobId={moved}", "StartTime=now"], check=False)
        return bool(said("done"))

    try:
        assert wait_until(started_again, 180, interval=1.0), (
            [(e.kind, e.slot, e.details) for e in events.read(history) if e.kind != "phase"],
            cluster.run(["squeue", "-h", "-o", "%i %T %r %N"], check=False).stdout,
        )
        assert wait_until(lambda: not cluster.squeue(), 120), cluster.squeue()
        verdicts = [(e.details["node"], e.details["healthy"]) for e in said("health")]
        assert [node for node, healthy in verdicts if healthy] == [good], verdicts
        assert {node for node, healthy in verdicts if not healthy} <= set(bad), verdicts
        unhealthy = [node for node, healthy in verdicts if not healthy]
        assert len(said("requeue")) == len(unhealthy) >= 1, [e.kind for e in events.read(history)]
        for requeue in said("requeue"):
            assert requeue.details["cause"] == "unhealthy"
            assert requeue.details["excluded"] == sorted(bad)
            shown = cluster.run(["scontrol", "-o", "show", "job", requeue.details["slurm_job"]])
            assert f"ExcNodeList={','.join(sorted(bad))}" in shown.stdout, shown.stdout
        assert len(said("join")) == 1, "only the agent on the good node may join"
    finally:
        with zookeeper.bad_node_book(cluster.zk_hosts, user, user_secret(secret_file)) as book:
            clear(book)
