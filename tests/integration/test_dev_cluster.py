"""The dev cluster behaves like the real clusters the project targets (see docs/dev-cluster.md)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import cluster as cluster_module
import pytest
from cluster import DEV_CLUSTER, Cluster, ClusterError, free_port, free_port_block, wait_until
from kazoo.client import KazooClient
from lifeline import while_parent_lives

from hpc_elastic.rendezvous.testing import free_ports

pytestmark = pytest.mark.integration


def _job_field(cluster: Cluster, job_id: str, key: str) -> str:
    record = cluster.run(["scontrol", "-o", "show", "job", job_id]).stdout
    return next(
        (item.split("=", 1)[1] for item in record.split() if item.startswith(f"{key}=")), ""
    )


def test_two_node_job_runs_one_task_on_each_node(cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nsrun bash -c 'echo $SLURMD_NODENAME'\n")
    out = tmp_path / "out.txt"
    job = cluster.run(["sbatch", "--parsable", "-N2", f"--output={out}", str(script)])
    job_id = job.stdout.strip()

    assert wait_until(lambda: _job_field(cluster, job_id, "JobState") == "COMPLETED", 30)
    assert sorted(out.read_text().split()) == ["n1", "n2"]


def test_high_partition_preempts_and_requeues_low(cluster: Cluster, tmp_path: Path) -> None:
    log = tmp_path / "signals.log"
    ready = tmp_path / "trap-set"
    script = tmp_path / "low.sh"
    # A fork-free trap: a handler that forks can lose the second of two back-to-back signals.
    # The script says when its trap is set: Slurm shows the job RUNNING from its allocation on,
    # before the batch script has started on a loaded node, and a signal sent then is lost.
    script.write_text(
        f"#!/bin/bash\ntrap 'echo USR1 >> {log}' USR1\n: > {ready}\nwhile true; do sleep 1; done\n"
    )
    low = cluster.run(
        ["sbatch", "--parsable", "-N4", "--signal=B:USR1@5", "-o", "/dev/null", str(script)]
    ).stdout.strip()
    high = ""
    try:
        assert wait_until(ready.exists, 120), "the low job's script never started"
        high = cluster.run(
            [
                "sbatch",
                "--parsable",
                "-p",
                "high",
                "-N4",
                "-o",
                "/dev/null",
                "--wrap",
                "exec sleep 300",
            ]
        ).stdout.strip()

        # The low partition's GraceTime (20 s) first, then a loaded slurmctld's own pace.
        assert wait_until(lambda: _job_field(cluster, high, "JobState") == "RUNNING", 180)
        assert _job_field(cluster, low, "JobState") == "PENDING"
        assert _job_field(cluster, low, "Restarts") == "1"
        assert log.read_text().split() == ["USR1"]
    finally:
        cluster.run(["scancel", low, *([high] if high else [])])


def test_zookeeper_grants_two_second_sessions(
    cluster: Cluster, zk_root: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(1, logger="kazoo.client")
    client = KazooClient(hosts=cluster.zk_hosts, timeout=2.0)
    client.start(timeout=10)
    try:
        assert "negotiated session timeout: 2000" in caplog.text
        crashed = subprocess.Popen(
            [sys.executable, "-c", _EPHEMERAL_OWNER, cluster.zk_hosts, f"{zk_root}/owner"],
            env=cluster.env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert crashed.stdout is not None
        assert crashed.stdout.readline().strip() == "ready"
        assert client.exists(f"{zk_root}/owner") is not None

        crashed.send_signal(signal.SIGKILL)
        crashed.wait()

        assert wait_until(lambda: client.exists(f"{zk_root}/owner") is None, 60)  # 2 s session
    finally:
        client.stop()
        client.close()


_EPHEMERAL_OWNER = """
import sys, time
from kazoo.client import KazooClient
client = KazooClient(hosts=sys.argv[1], timeout=2.0)
client.start(timeout=10)
client.create(sys.argv[2], ephemeral=True, makepath=True)
print("ready", flush=True)
""" + while_parent_lives("time.sleep(0.1)")
"""Holds its session until the test SIGKILLs it (or the test's own process is gone)."""


def _tasks_named(cluster: Cluster, name: str) -> int:
    """How many of the cluster's job processes are called ``name``."""
    return sum(entry.split()[1] == name for entry in cluster.strays())


def _command_lines_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args:
            found.append(args)
    return found


def test_node_kill_takes_the_nodes_tasks_with_it(cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nsrun bash -c 'echo $SLURMD_NODENAME $$ >> pids; sleep 300'\n")
    job_id = cluster.run(
        ["sbatch", "--parsable", "-N4", "-o", "/dev/null", f"--chdir={tmp_path}", str(script)]
    ).stdout.strip()
    pids = tmp_path / "pids"
    assert wait_until(lambda: pids.exists() and len(pids.read_text().splitlines()) == 4, 30)
    task_on = dict(line.split() for line in pids.read_text().splitlines())

    cluster.node_kill("n4")
    try:
        assert not _alive(task_on["n4"])
        assert all(_alive(task_on[node]) for node in ("n1", "n2", "n3"))
    finally:
        cluster.run(["scancel", job_id])
        cluster.node_start("n4")
    assert wait_until(lambda: _node_state(cluster, "n4") == "idle", 30)


def _alive(pid: str) -> bool:
    """Running, as opposed to gone or a zombie that nobody has reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _node_state(cluster: Cluster, node: str) -> str:
    return cluster.run(["sinfo", "-h", "-n", node, "-o", "%T"]).stdout.strip()


def test_zookeeper_restarts_with_its_data(cluster: Cluster, zk_root: str) -> None:
    client = KazooClient(hosts=cluster.zk_hosts, timeout=5.0)
    client.start(timeout=10)
    client.create(f"{zk_root}/kept", b"v1", makepath=True)
    client.stop()
    client.close()

    cluster.zk_stop()
    cluster.zk_start()

    client = KazooClient(hosts=cluster.zk_hosts, timeout=5.0)
    client.start(timeout=10)
    try:
        assert client.get(f"{zk_root}/kept")[0] == b"v1"
    finally:
        client.stop()
        client.close()


def test_down_leaves_nothing_behind_even_after_a_node_crash(tmp_path: Path) -> None:
    """A second, private cluster, so that stopping it cannot disturb the shared one."""
    private = Cluster.start(tmp_path / "state")
    try:
        private.run(["sbatch", "-N2", "-o", "/dev/null", "--wrap", "srun sleep 300"])
        # Slurm shows the job RUNNING from its allocation on, before a loaded node has started
        # anything: wait for the step's task on each node, the processes the crash must orphan.
        running = wait_until(lambda: _tasks_named(private, "sleep") == 2, 120)
        assert running, private.run(["squeue", "-o", "%i %T %r %N"]).stdout
        private.node_kill("n2")
        assert private.strays()
    finally:
        private.stop()
        private.stop()

    assert private.strays() == []
    assert _command_lines_mentioning(str(tmp_path / "state")) == []


def test_a_cluster_brought_up_with_no_standard_input_runs_batch_jobs(tmp_path: Path) -> None:
    """CI runs scripts/test-all with fd 0 closed. Daemons started so used to take fd 0 for
    a file of their own, and every batch job then failed at launch (CI failed twice so)."""
    state = tmp_path / "state"
    ports = [
        *("--zk-port", str(free_port())),
        *("--slurmctld-port", str(free_port())),
        *("--slurmd-port-base", str(free_port_block(4))),
    ]
    up = [str(DEV_CLUSTER), "--state-dir", str(state), *ports, "up"]
    try:
        started = subprocess.run(
            ["bash", "-c", 'exec 0<&- && exec "$@"', "bash", *up],
            capture_output=True,
            text=True,
            check=False,
            timeout=cluster_module.UP_BACKSTOP,
        )
    except subprocess.TimeoutExpired:
        subprocess.run([str(DEV_CLUSTER), "--state-dir", str(state), "down"], check=False)
        raise
    private = Cluster.from_state_dir(state)
    try:
        assert started.returncode == 0, started.stderr
        out = tmp_path / "out.txt"
        job = private.run(["sbatch", "--parsable", "-N2", f"--output={out}", "--wrap", "srun true"])
        job_id = job.stdout.strip()
        done = wait_until(lambda: _job_field(private, job_id, "JobState") == "COMPLETED", 60)
        assert done, private.run(["scontrol", "show", "job", job_id]).stdout
    finally:
        private.stop()


@pytest.mark.parametrize(
    ("daemon", "option"), [("ZooKeeper", "--zk-port"), ("slurmctld", "--slurmctld-port")]
)
def test_a_port_someone_else_holds_fails_up_at_once_naming_the_port_and_its_holder(
    daemon: str, option: str, tmp_path: Path
) -> None:
    """A port found free can be taken before its daemon binds it (on a busy machine, anyone's
    ``bind(0)``: a CI run's slurmctld died so, "Address already in use"). The daemon exits at
    start, and up says so at once, not after waiting out its deadline: that wait once
    outlived the harness's own, which killed up unheard and left the rest running."""
    state = tmp_path / "state"
    zk_port, slurmctld_port = free_ports(2)
    held = {"--zk-port": zk_port, "--slurmctld-port": slurmctld_port}[option]
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", held))
        holder.listen()
        ports = [
            *("--zk-port", str(zk_port)),
            *("--slurmctld-port", str(slurmctld_port)),
            *("--slurmd-port-base", str(free_port_block(4))),
        ]
        up = [str(DEV_CLUSTER), "--state-dir", str(state), *ports, "up"]
        try:
            started = subprocess.run(up, capture_output=True, text=True, check=False, timeout=300)
        finally:
            subprocess.run([str(DEV_CLUSTER), "--state-dir", str(state), "down"], check=False)

    said = started.stderr.splitlines()[-1]
    assert started.returncode == 1
    assert said.startswith(
        f"dev-cluster: {daemon} exited at start: port {held} is taken (users:(("
    ), started.stderr
    assert f",pid={os.getpid()}," in said
    assert said.endswith(f"); pick another {option}.")
    assert _command_lines_mentioning(str(state)) == []


def test_an_up_that_hangs_past_its_backstop_is_one_error_and_leaves_nothing_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Slurm command that never answers (here every ``sinfo``, which up polls for idle
    nodes) holds up past the harness's backstop: the harness kills it with what it started in
    its session, takes down the daemons that had forked off, and raises one ClusterError."""
    shims = tmp_path / "bin"
    shims.mkdir()
    # Named by its own path, under tmp_path, so that a survivor would be found below.
    (shims / "sinfo").write_text('#!/bin/bash\nexec -a "$0" sleep 600\n')
    (shims / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shims}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(cluster_module, "UP_BACKSTOP", 20.0)
    state = tmp_path / "state"

    with pytest.raises(ClusterError) as failed:
        Cluster.start(state)

    assert str(failed.value).endswith(" up did not finish within 20 s."), failed.value
    assert _command_lines_mentioning(str(tmp_path)) == []


_CONNECTS = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5).close()
except OSError:
    sys.exit(1)
"""


def _reaches(cluster: Cluster, node: str, host: str, port: int) -> bool:
    """Whether a TCP connection from inside ``node``'s namespace to host:port succeeds."""
    probe = cluster.in_node_net(node, [sys.executable, "-c", _CONNECTS, host, str(port)])
    return subprocess.run(probe, check=False, timeout=30).returncode == 0


def test_a_node_in_its_own_namespace_loses_exactly_the_links_that_are_cut(
    tmp_path: Path,
) -> None:
    """A private --netns cluster: n1's links to ZooKeeper and to n2 are cut one by one."""
    state = tmp_path / "state"
    private = Cluster.start(state, netns=True)
    try:
        slurmd_n2 = int((state / "ports").read_text().split("SLURMD_BASE_SAVED=")[1].split()[0]) + 1
        zk = (private.zk_host, private.zk_port)
        n2 = (private.node_address("n2"), slurmd_n2)
        out = tmp_path / "host.txt"
        private.run(
            ["sbatch", "-w", "n2", "-o", str(out), "--wrap", "srun printenv HPC_ELASTIC_HOST"]
        )
        assert wait_until(lambda: out.exists() and out.read_text().strip() != "", 30)
        assert out.read_text().split() == [private.node_address("n2")]
        assert _reaches(private, "n1", *zk)
        assert _reaches(private, "n1", *n2)

        private.link_cut("n1", "zk")
        assert not _reaches(private, "n1", *zk)
        assert _reaches(private, "n1", *n2)
        assert _reaches(private, "n2", *zk)

        private.link_cut("n1", "peers")
        assert not _reaches(private, "n1", *n2)

        private.link_heal("n1")
        assert _reaches(private, "n1", *zk)
        assert _reaches(private, "n1", *n2)
        net_id = (state / "ports").read_text().split("NET_ID_SAVED=")[1].split()[0]
    finally:
        private.stop()

    namespaces = subprocess.run(
        ["ip", "netns", "list"], check=True, capture_output=True, text=True
    ).stdout
    assert f"hpe{net_id}-" not in namespaces
    assert not Path(f"/sys/class/net/hpe{net_id}-br").exists()
    assert private.strays() == []
