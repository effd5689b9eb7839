"""The user's own ZooKeeper ensemble (``hpc-elastic zk``) without a cluster: finding ZooKeeper and
Java, port choice, ``zoo.cfg``, ``mntr``/``srvr``, the connect-string file and whom it trusts,
which ZooKeeper a command uses, and ``zk start``'s Slurm side on the fake Slurm seam.

The cluster tests are in tests/integration/test_zk_cluster.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner
from cluster import wait_until
from slurm_fake import mocked_slurm
from unix_users import UnixUser, mallory, shared

from hpc_elastic import cli, contract, doctor
from hpc_elastic.ensemble import (
    admin,
    choice,
    files,
    fourletter,
    install,
    lifecycle,
    supervisor,
    zoocfg,
)
from hpc_elastic.ensemble import server as server_module
from hpc_elastic.ensemble.files import Ensemble, Layout, Server, StartRecord
from hpc_elastic.errors import EnsembleError, EnsembleTrustError, UsageError
from hpc_elastic.rendezvous import testing
from hpc_elastic.slurm.commands import JobStatus, SlurmJobId

__all__ = ["mallory", "shared"]  # fixtures, used by name


# --- finding ZooKeeper and Java ----------------------------------------------------------------


@dataclass
class FakeFileSystem:
    """Files, directories and executables by path; ``links`` resolve like ``realpath``."""

    paths: set[str] = field(default_factory=set)
    executables: set[str] = field(default_factory=set)
    links: dict[str, str] = field(default_factory=dict)

    def add(self, *paths: str) -> FakeFileSystem:
        for path in paths:
            self.paths.add(path)
            parts = path.split("/")
            for depth in range(2, len(parts)):
                self.paths.add("/".join(parts[:depth]) + "/")
        return self

    def program(self, path: str) -> FakeFileSystem:
        self.executables.add(path)
        return self.add(path)

    def is_dir(self, path: str) -> bool:
        return path.rstrip("/") + "/" in self.paths

    def is_file(self, path: str) -> bool:
        return path in self.paths

    def executable(self, path: str) -> bool:
        return path in self.executables

    def glob(self, pattern: str) -> list[str]:
        import fnmatch  # noqa: PLC0415

        return sorted(
            path
            for path in self.paths
            if not path.endswith("/")
            and fnmatch.fnmatch(path, pattern)
            and path.count("/") == pattern.count("/")
        )

    def realpath(self, path: str) -> str:
        return self.links.get(path, path)

    def which(self, name: str, search_path: str) -> str | None:
        for directory in search_path.split(":"):
            if f"{directory}/{name}" in self.executables:
                return f"{directory}/{name}"
        return None


TARBALL = "/opt/apache-zookeeper-3.8.4-bin"


def a_machine() -> FakeFileSystem:
    """Java on PATH, Debian's ZooKeeper, an unpacked release and a conda environment."""
    fs = FakeFileSystem()
    fs.program("/usr/bin/java")
    fs.add(install.DEBIAN_JAR, "/usr/share/zookeeper/bin/zkServer.sh")
    fs.add(f"{TARBALL}/lib/zookeeper-3.8.4.jar", f"{TARBALL}/lib/netty.jar")
    fs.add(f"{TARBALL}/conf/logback.xml")
    fs.program(f"{TARBALL}/bin/zkServer.sh")
    fs.add("/conda/env/libexec/zookeeper/lib/zookeeper-3.8.4.jar")
    return fs


def test_zookeeper_home_comes_first_with_its_conf_and_every_jar_of_its_lib() -> None:
    environ = {"ZOOKEEPER_HOME": TARBALL, "PATH": "/usr/bin", "CONDA_PREFIX": "/conda/env"}
    found = install.find_installation(environ, a_machine())
    assert found.classpath == f"{TARBALL}/conf:{TARBALL}/lib/*"
    assert found.java == "/usr/bin/java"
    assert TARBALL in found.zookeeper


def test_a_zkserver_script_on_path_comes_before_the_distributions_package() -> None:
    fs = a_machine()
    fs.program("/usr/local/bin/zkServer.sh")
    fs.links["/usr/local/bin/zkServer.sh"] = f"{TARBALL}/bin/zkServer.sh"  # a module's link
    found = install.find_installation({"PATH": "/usr/local/bin:/usr/bin"}, fs)
    assert found.classpath == f"{TARBALL}/conf:{TARBALL}/lib/*"
    assert "zkServer.sh on PATH" in found.zookeeper


def test_debians_zkserver_on_path_falls_through_to_its_jar() -> None:
    """Debian's zkServer.sh lives in /usr/share/zookeeper/bin, a home without jars."""
    fs = a_machine()
    fs.program("/usr/share/zookeeper/bin/zkServer.sh")
    found = install.find_installation({"PATH": "/usr/share/zookeeper/bin:/usr/bin"}, fs)
    assert found.classpath == install.DEBIAN_JAR


def test_a_conda_environment_is_the_last_place_looked_at() -> None:
    fs = a_machine()
    fs.paths.discard(install.DEBIAN_JAR)
    found = install.find_installation({"PATH": "/usr/bin", "CONDA_PREFIX": "/conda/env"}, fs)
    assert found.classpath == "/conda/env/libexec/zookeeper/lib/*"
    assert "conda" in found.zookeeper


def test_a_zookeeper_home_without_zookeeper_is_named() -> None:
    with pytest.raises(EnsembleError, match=r"ZOOKEEPER_HOME '/opt/empty' holds no ZooKeeper"):
        install.find_installation({"ZOOKEEPER_HOME": "/opt/empty"}, a_machine())


def test_java_home_wins_over_path_and_one_without_java_is_named() -> None:
    fs = a_machine().program("/jdk/bin/java")
    assert install.find_installation({"JAVA_HOME": "/jdk", "PATH": "/usr/bin"}, fs).java == (
        "/jdk/bin/java"
    )
    with pytest.raises(EnsembleError, match=r"JAVA_HOME '/nojdk' has no executable bin/java"):
        install.find_installation({"JAVA_HOME": "/nojdk", "PATH": "/usr/bin"}, fs)


def test_missing_zookeeper_is_one_sentence_with_every_way_to_get_it() -> None:
    fs = FakeFileSystem().program("/usr/bin/java")
    with pytest.raises(EnsembleError) as caught:
        install.find_installation({"PATH": "/usr/bin"}, fs)
    sentence = str(caught.value)
    assert sentence.startswith("ZooKeeper (ZOOKEEPER_HOME is unset")
    for way in ("module load zookeeper", "conda install -c conda-forge zookeeper", "apt install"):
        assert way in sentence
    assert re.search(r"\. [A-Z]", sentence) is None  # one sentence
    assert sentence.endswith(".")


def test_missing_java_is_one_sentence_with_every_way_to_get_it() -> None:
    fs = a_machine()
    fs.executables.discard("/usr/bin/java")
    with pytest.raises(EnsembleError) as caught:
        install.find_installation({"PATH": "/usr/bin"}, fs)
    sentence = str(caught.value)
    assert sentence.startswith("Java (JAVA_HOME is unset and no java is on PATH) was not found")
    for way in ("module load java", "conda install -c conda-forge openjdk", "apt install"):
        assert way in sentence


def test_both_missing_are_named_in_one_sentence() -> None:
    with pytest.raises(EnsembleError, match=r"^Neither ZooKeeper .* nor Java .* was found; "):
        install.find_installation({"PATH": "/usr/bin"}, FakeFileSystem())


# --- ports and zoo.cfg ---------------------------------------------------------------------------


def test_ports_are_the_first_free_candidates_each_once() -> None:
    taken = {20001, 20003}
    claimed: list[int] = []

    def claim(port: int) -> bool:
        if port in taken or port in claimed:
            return False
        claimed.append(port)
        return True

    chosen = zoocfg.choose_ports(3, [20001, 20002, 20002, 20003, 20004, 20005], claim)
    assert chosen == [20002, 20004, 20005]


def test_a_range_without_enough_free_ports_is_one_sentence() -> None:
    with pytest.raises(
        EnsembleError, match=r"Only 1 of the 3 ports .* among the 2 tried; .*--ports"
    ):
        zoocfg.choose_ports(3, [30000, 30001], lambda port: port == 30000)


def test_candidates_cover_the_range_in_an_order_of_their_own() -> None:
    first = zoocfg.port_candidates((20000, 20099), random.Random(1))
    second = zoocfg.port_candidates((20000, 20099), random.Random(2))
    assert sorted(first) == sorted(second) == list(range(20000, 20100))
    assert first != second


def test_the_default_port_range_lies_below_the_ephemeral_ports() -> None:
    low, high = contract.DEFAULT_ZK_PORTS
    assert low >= 1024
    assert high < 32768


@pytest.mark.parametrize("text", ["100:200", "30000", "40000:39999", "30000:30001", "a:b"])
def test_a_bad_port_range_is_quoted(text: str) -> None:
    with pytest.raises(UsageError, match=rf"--ports '{text}' is not LOW:HIGH"):
        zoocfg.parse_ports(text)


def peer(myid: int) -> Server:
    return Server(myid, f"10.0.0.{myid}", 21000 + myid, 22000 + myid, 23000 + myid, f"s{myid}")


def test_zoo_cfg_names_every_server_and_is_secure_by_default() -> None:
    config = zoocfg.ServerConfig(2, "/l/d", "/l/t", 21002, (peer(3), peer(1), peer(2)))
    lines = zoocfg.render_zoo_cfg(config).splitlines()
    assert "4lw.commands.whitelist=srvr,mntr,ruok" in lines
    assert "admin.enableServer=false" in lines
    assert f"authProvider.1={zoocfg.DIGEST_PROVIDER}" in lines
    assert "DigestAuthenticationProvider.digestAlg=SHA1" in lines
    assert "skipACL=no" in lines
    assert {"dataDir=/l/d", "dataLogDir=/l/t", "clientPort=21002"} <= set(lines)
    assert {"autopurge.snapRetainCount=3", "autopurge.purgeInterval=1"} <= set(lines)
    assert {"minSessionTimeout=2000", "maxSessionTimeout=60000"} <= set(lines)
    assert {"tickTime=250", "initLimit=120", "syncLimit=40"} <= set(lines)  # 30 s and 10 s
    assert [line for line in lines if line.startswith("server.")] == [
        "server.1=10.0.0.1:22001:23001",
        "server.2=10.0.0.2:22002:23002",
        "server.3=10.0.0.3:22003:23003",
    ]


def test_the_followers_limits_stay_in_seconds_whatever_the_tick() -> None:
    config = zoocfg.ServerConfig(1, "/d", "/t", 2181, (peer(1),), tick_ms=2000)
    lines = zoocfg.render_zoo_cfg(config).splitlines()
    assert {"tickTime=2000", "initLimit=15", "syncLimit=5"} <= set(lines)
    assert zoocfg.ticks(10, 3000) == 4  # never shorter than asked


def test_a_standalone_server_names_no_peers() -> None:
    text = zoocfg.render_zoo_cfg(zoocfg.ServerConfig(1, "/d", "/t", 2181))
    assert not [line for line in text.splitlines() if line.startswith("server.")]
    assert "(standalone)" in text


def test_what_each_ensemble_size_survives() -> None:
    assert [(n, zoocfg.quorum(n), zoocfg.survives(n)) for n in (1, 3, 5)] == [
        (1, 1, 0),
        (3, 2, 1),
        (5, 3, 2),
    ]


def test_missing_peers_are_those_not_published_yet() -> None:
    assert zoocfg.missing_peers({1: peer(1), 3: peer(3)}, 3) == [2]
    assert zoocfg.missing_peers({1: peer(1), 2: peer(2), 3: peer(3)}, 3) == []


# --- mntr and srvr ---------------------------------------------------------------------------

MNTR_LEADER = (
    "zk_version\t3.8.0-debian--1, built on 2024-06-16 00:00 UTC\n"
    "zk_server_state\tleader\n"
    "zk_num_alive_connections\t4\n"
    "zk_avg_latency\t0.4567\n"
    "zk_max_latency\t12\n"
    "zk_min_latency\t0\n"
    "zk_followers\t2\n"
)
SRVR_FOLLOWER = (
    "Zookeeper version: 3.8.0-debian--1, built on 2024-06-16\n"
    "Latency min/avg/max: 0/1.25/30\n"
    "Received: 10\nSent: 9\nConnections: 2\nOutstanding: 0\nZxid: 0x100000003\n"
    "Mode: follower\nNode count: 7\n"
)


def test_mntr_gives_mode_clients_and_latency() -> None:
    health = fourletter.from_mntr("h:1", MNTR_LEADER)
    assert health == fourletter.Health("h:1", "leader", 4, 0.4567, 12.0, "3.8.0")
    assert health.serving


def test_srvr_gives_the_same_when_mntr_is_not_allowed() -> None:
    health = fourletter.from_srvr("h:2", SRVR_FOLLOWER)
    assert health == fourletter.Health("h:2", "follower", 2, 1.25, 30.0, "3.8.0")


def test_a_server_without_a_quorum_says_so_and_does_not_serve() -> None:
    text = "This ZooKeeper instance is not currently serving requests\n"
    assert fourletter.from_mntr("h:3", text).mode == "no quorum"
    assert not fourletter.from_srvr("h:3", text).serving


def test_the_ensemble_is_serving_degraded_or_without_quorum() -> None:
    leader = fourletter.Health("a", "leader")
    follower = fourletter.Health("b", "follower")
    down = fourletter.Health("c", "down")
    looking = fourletter.Health("c", "no quorum")
    assert fourletter.quorum_state([leader, follower, follower]) == "serving"
    assert fourletter.quorum_state([leader, follower, down]) == "degraded"
    assert fourletter.quorum_state([leader, looking, follower]) == "degraded"
    assert fourletter.quorum_state([looking, looking, down]) == "no quorum"
    assert fourletter.quorum_state([fourletter.Health("a", "standalone")]) == "serving"


# --- the connect-string file ---------------------------------------------------------------------


def an_ensemble(job_id: str = "12") -> Ensemble:
    return Ensemble(servers=(peer(1), peer(2), peer(3)), job_id=job_id, run_dir="/r")


@pytest.fixture
def layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Layout:
    """The user's state directory, empty, under ``tmp_path``."""
    monkeypatch.setenv(contract.STATE_DIR_ENV, str(tmp_path / "state"))
    return Layout.of()


def publish(layout: Layout, ensemble: Ensemble) -> None:
    files.ensure_private_dir(layout.root)
    files.write_private(layout.ensemble_file, files.encode(ensemble))


def test_the_ensemble_file_is_written_0600_and_read_back(layout: Layout) -> None:
    publish(layout, an_ensemble())
    assert layout.ensemble_file.stat().st_mode & 0o777 == 0o600
    assert layout.root.stat().st_mode & 0o777 == 0o700
    assert files.load_ensemble(layout) == an_ensemble()
    assert an_ensemble().connect == "10.0.0.1:21001,10.0.0.2:21002,10.0.0.3:21003"


def test_records_survive_the_round_trip() -> None:
    record = StartRecord(3, "/usr/bin/java", "/zk/lib/*", job_id="7", ports=(21000, 21999))
    path = Path("/x/start.json")
    assert files.decode_start(files.encode(record), path) == record
    assert files.decode_server(json.loads(files.encode(peer(2))), path) == peer(2)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"format": 9}, "its format is 9"),
        ({"servers": []}, "its field 'servers'"),
        ({"min_session_ms": "2000"}, "its field 'min_session_ms'"),
    ],
)
def test_a_record_with_a_bad_field_is_one_sentence_naming_it(
    layout: Layout, change: dict[str, object], named: str
) -> None:
    document = json.loads(files.encode(an_ensemble()))
    document.update(change)
    files.ensure_private_dir(layout.root)
    files.write_private(layout.ensemble_file, json.dumps(document).encode())
    with pytest.raises(
        EnsembleError, match=rf"^Ensemble record '.*' cannot be used because {named}"
    ):
        files.load_ensemble(layout)


def test_a_server_with_a_comma_in_its_host_is_refused() -> None:
    document = json.loads(files.encode(peer(1)))
    document["host"] = "10.0.0.1:1,evil"
    with pytest.raises(EnsembleError, match="its field 'host'"):
        files.decode_server(document, Path("/p/1.json"))


def test_a_link_in_place_of_the_ensemble_file_is_refused(layout: Layout, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_bytes(files.encode(an_ensemble()))
    files.ensure_private_dir(layout.root)
    layout.ensemble_file.symlink_to(elsewhere)
    with pytest.raises(EnsembleTrustError, match=r"is not trusted because it is a symbolic link"):
        files.load_ensemble(layout)


def test_an_ensemble_file_others_may_write_is_refused(layout: Layout) -> None:
    publish(layout, an_ensemble())
    layout.ensemble_file.chmod(0o620)
    with pytest.raises(EnsembleTrustError, match=r"group or others may write it \(mode 0620\)"):
        files.load_ensemble(layout)


def test_an_ensemble_file_in_a_directory_others_may_enter_is_refused(layout: Layout) -> None:
    publish(layout, an_ensemble())
    layout.root.chmod(0o777)
    with pytest.raises(EnsembleTrustError, match=r"its directory '.*' is not: group or others"):
        files.load_ensemble(layout)


def test_an_ensemble_file_of_another_user_is_refused(layout: Layout) -> None:
    publish(layout, an_ensemble())
    someone_else = os.geteuid() + 1  # as that user sees the file of ours
    with pytest.raises(EnsembleTrustError, match=rf"owned by user id {os.geteuid()}, not by you"):
        files.read_trusted(layout.ensemble_file, uid=someone_else)


# --- which ZooKeeper a command uses ------------------------------------------------------------


def test_the_flag_then_the_variable_then_the_config_file_then_the_ensemble(layout: Layout) -> None:
    publish(layout, an_ensemble())
    config = Path("/p/hpc-elastic.toml")
    env = {contract.STATE_DIR_ENV: str(layout.root.parent), contract.ZK_ENV: "v:1"}
    assert choice.choose_zk("f:1", {"zk": "v:1"}, config, env).source == "--zk"
    assert choice.choose_zk(None, {"zk": "v:1"}, config, env).source == "$HPC_ELASTIC_ZK"
    del env[contract.ZK_ENV]
    from_file = choice.choose_zk(None, {"zk": "c:1"}, config, env)
    assert (from_file.address, from_file.source) == ("c:1", f"the config file {config}")
    ours = choice.choose_zk(None, {}, None, env)
    assert ours.address == an_ensemble().connect
    assert ours.line() == (
        f"ZooKeeper: {an_ensemble().connect} (your ensemble of 3 servers, Slurm job 12)"
    )


def test_without_any_the_default_is_said_to_be_a_guess(layout: Layout) -> None:
    env = {contract.STATE_DIR_ENV: str(layout.root.parent)}
    guess = choice.choose_zk(None, {}, None, env)
    assert guess.address == contract.DEFAULT_ZK
    assert "`hpc-elastic zk start` starts one" in guess.line()


def squeue_listing(*job_ids: str) -> object:
    def squeue(wanted: object) -> list[JobStatus]:
        return [JobStatus(SlurmJobId(job), None, "RUNNING", "None", "s1") for job in job_ids]

    return squeue


def test_a_job_is_not_submitted_to_an_ensemble_whose_slurm_job_ended(layout: Layout) -> None:
    publish(layout, an_ensemble("12"))
    env = {contract.STATE_DIR_ENV: str(layout.root.parent)}
    address = an_ensemble().connect
    choice.require_alive(address, env, squeue_listing("12"))  # type: ignore[arg-type]
    with pytest.raises(EnsembleError, match=r"Slurm job 12 is no longer listed by squeue"):
        choice.require_alive(address, env, squeue_listing())  # type: ignore[arg-type]
    choice.require_alive("elsewhere:2181", env, squeue_listing())  # type: ignore[arg-type]


# --- zk start's Slurm side, on the fake Slurm ------------------------------------------------

CONFIG = "PreemptType = preempt/partition_prio\nPreemptMode = REQUEUE\n"
LOW = (
    "PartitionName=low Default=YES QoS=N/A PreemptMode=REQUEUE OverSubscribe=EXCLUSIVE "
    "Nodes=n[1-4]\n"
)
SERVICE = "PartitionName=service Default=NO QoS=N/A PreemptMode=OFF OverSubscribe=NO Nodes=s1\n"


def test_a_partition_that_may_preempt_is_named_and_one_that_never_does_passes() -> None:
    config = {"PreemptType": "preempt/partition_prio"}
    low = {"PartitionName": "low", "PreemptMode": "REQUEUE"}
    assert lifecycle.preemption_refusal(config, low) == (
        "partition 'low' has PreemptMode=REQUEUE under preempt/partition_prio"
    )
    assert lifecycle.preemption_refusal(config, {"PreemptMode": "OFF"}) is None
    assert lifecycle.preemption_refusal({"PreemptType": "preempt/none"}, low) is None
    qos = {"PartitionName": "p", "PreemptMode": "OFF", "QoS": "normal"}
    assert "QoS 'normal'" in str(lifecycle.preemption_refusal({"PreemptType": "preempt/qos"}, qos))


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """This machine as the search sees it, whatever is installed: Java and ZooKeeper in
    ``tmp_path``, found through ZOOKEEPER_HOME and JAVA_HOME."""
    home = tmp_path / "zookeeper"
    (home / "lib").mkdir(parents=True)
    (home / "lib" / "zookeeper-3.8.4.jar").write_bytes(b"")
    java = tmp_path / "jdk" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text("#!/bin/sh\n")
    java.chmod(0o755)
    monkeypatch.setenv("ZOOKEEPER_HOME", str(home))
    monkeypatch.setenv("JAVA_HOME", str(java.parent.parent))
    return tmp_path


def test_zk_start_refuses_a_partition_that_may_preempt_before_submitting(
    layout: Layout, machine: Path
) -> None:
    with mocked_slurm() as fake:
        fake.answer("scontrol", "-o", "show", "partition", "low", stdout=LOW)
        fake.answer("scontrol", "show", "config", stdout=CONFIG)
        result = CliRunner().invoke(cli.app, ["zk", "start", "--partition", "low"])
    assert result.exit_code == 1
    assert result.stderr.startswith(
        "error: The ensemble could be preempted because partition 'low' has PreemptMode=REQUEUE"
    )
    assert "--allow-preemption" in result.stderr
    assert fake.ran("sbatch") == []
    assert not layout.run_dir.exists()


def test_zk_start_submits_one_job_of_one_step_per_server(layout: Layout, machine: Path) -> None:
    with mocked_slurm() as fake:
        fake.answer("scontrol", "-o", "show", "partition", "service", stdout=SERVICE)
        fake.answer("scontrol", "show", "config", stdout=CONFIG)
        fake.answer("squeue", stdout="")
        fake.answer("sbatch", stdout="41\n")
        result = CliRunner().invoke(
            cli.app,
            ["zk", "start", "--servers", "5", "--spares", "1", "--partition=service", "--no-wait"],
        )
    assert result.exit_code == 0, result.stderr
    assert (
        "Submitted Slurm job 41: a ZooKeeper ensemble of 5 servers and 1 spare node"
        in result.stdout
    )
    script = layout.script.read_text()
    for line in ("--nodes=6", "--ntasks-per-node=1", "--no-kill", "--no-requeue"):
        assert f"#SBATCH {line}" in script
    assert "#SBATCH --partition=service" in script
    assert f"-m hpc_elastic zk supervise --run-dir {layout.run_dir}" in script
    start = files.load_start(layout)
    assert start is not None
    assert (start.servers, start.spares, start.job_id) == (5, 1, "41")
    assert layout.secret_file.stat().st_mode & 0o777 == 0o600
    assert files.load_secret(layout)
    assert start.java == str(machine / "jdk" / "bin" / "java")
    assert start.classpath == f"{machine / 'zookeeper'}/lib/*"
    assert layout.run_dir.stat().st_mode & 0o777 == 0o700


def test_zk_start_with_java_missing_from_path_fails_in_one_sentence(
    layout: Layout, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with mocked_slurm() as fake:
        result = CliRunner().invoke(cli.app, ["zk", "start"])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: ")
    assert "Java (JAVA_HOME is unset and no java is on PATH) was not found" in lines[0]
    assert fake.calls == []


def test_zk_start_with_zookeeper_missing_fails_in_one_sentence(
    layout: Layout, machine: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("ZOOKEEPER_HOME")
    monkeypatch.delenv("CONDA_PREFIX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(install, "DEBIAN_JAR", str(tmp_path / "no-debian" / "zookeeper.jar"))
    with mocked_slurm() as fake:
        result = CliRunner().invoke(cli.app, ["zk", "start"])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: ZooKeeper (ZOOKEEPER_HOME is unset")
    assert "conda install -c conda-forge zookeeper" in lines[0]
    assert fake.calls == []


def test_a_running_ensemble_is_not_started_twice(layout: Layout, machine: Path) -> None:
    publish(layout, an_ensemble("12"))
    with mocked_slurm() as fake:
        fake.answer("scontrol", "-o", "show", "partition", "service", stdout=SERVICE)
        fake.answer("scontrol", "show", "config", stdout=CONFIG)
        fake.answer("squeue", stdout="12|N/A|RUNNING|None|s1\n")
        result = CliRunner().invoke(cli.app, ["zk", "start", "--partition", "service"])
    assert result.exit_code == 1
    assert "Your ensemble (Slurm job 12) already runs" in result.stderr
    assert fake.ran("sbatch") == []


def test_a_server_step_that_ended_shows_in_its_slurm_state() -> None:
    running = JobStatus(SlurmJobId("12"), None, "RUNNING", "None", "s[1-3]")
    server = Server(1, "h", 1, 2, 3, "s1", step="12.0")
    assert lifecycle.step_state(server, running, {"12.0": {"State": "RUNNING"}}) == "RUNNING"
    assert lifecycle.step_state(server, running, {}) == "step ended"
    assert lifecycle.step_state(server, None, {}) == "job ended"


@dataclass
class Record:
    """What ``users_of`` reads of a ``JobRecord``."""

    run_id: str
    job_id: str | None
    zk: str | None
    local: bool = False


def test_the_jobs_that_use_an_ensemble_are_those_naming_its_servers() -> None:
    ensemble = an_ensemble()
    mine = Record("a", "20", ",".join(reversed(ensemble.connect.split(","))) + "/chroot")
    records = [mine, Record("b", "21", "other:2181"), Record("c", None, ensemble.connect)]
    assert lifecycle.users_of(ensemble, records) == [mine]


def test_zk_stop_refuses_while_a_job_of_yours_uses_the_ensemble(layout: Layout) -> None:
    publish(layout, an_ensemble("12"))
    user = Record("train-1", "20", an_ensemble().connect)
    with mocked_slurm() as fake:
        fake.answer("squeue", stdout="20|0|RUNNING|None|n1\n")
        with pytest.raises(EnsembleError, match=r"is still used by train-1 \(Slurm job 20"):
            lifecycle.stop(files.find(), False, print, records=lambda: [user])
    assert fake.ran("scancel") == []
    assert layout.ensemble_file.exists()


# --- a connect-string file another user planted or replaced --------------------------------------


def test_a_connect_string_file_another_user_planted_is_refused(
    mallory: UnixUser, shared: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state directory lies in a group project directory that mallory may write: she
    makes the ``zk`` directory and an ``ensemble.json`` naming her own ZooKeeper before the
    user's first submit. The submit refuses it in one sentence, and never renders her address."""
    state = shared / "project" / "state"
    monkeypatch.setenv(contract.STATE_DIR_ENV, str(state))
    hers = json.loads(files.encode(Ensemble(servers=(peer(1),), job_id="66")))
    hers["servers"][0]["host"] = "mallory.example.org"
    mallory.sh(
        f"mkdir -p {state}/zk && cat > {state}/zk/ensemble.json <<'EOF'\n{json.dumps(hers)}\nEOF"
    )
    result = CliRunner().invoke(cli.app, ["render", "train.py"])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"error: Ensemble file '{state}/zk/ensemble.json' is not trusted")
    assert f"owned by user id {mallory.uid}, not by you" in lines[0]
    assert "mallory.example.org" not in result.stdout


def test_a_connect_string_file_another_user_replaced_is_refused(
    mallory: UnixUser, shared: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user's zk directory was left open (0777): mallory swaps the ensemble file for a
    link to a file of hers, then for her own file; both are refused, by ``submit`` too."""
    monkeypatch.setenv(contract.STATE_DIR_ENV, str(shared / "mine"))
    layout = Layout.of()
    publish(layout, an_ensemble())
    layout.root.parent.chmod(0o755)
    layout.root.chmod(0o777)
    target = layout.ensemble_file
    mallory.sh(f"rm -f {target} && ln -s /tmp/hers.json {target}")
    linked = CliRunner().invoke(cli.app, ["submit", "train.py"])
    assert linked.exit_code == 1
    assert "is not trusted because it is a symbolic link" in linked.stderr
    hers = files.encode(Ensemble(servers=(peer(1),), job_id="66")).decode()
    mallory.sh(f"rm -f {target} && cat > {target} <<'EOF'\n{hers}EOF")
    replaced = CliRunner().invoke(cli.app, ["submit", "train.py"])
    assert replaced.exit_code == 1
    assert "is not trusted because" in replaced.stderr
    assert len(replaced.stderr.splitlines()) == 1


# --- doctor's checks of the ensemble -----------------------------------------------------------


def test_doctor_names_the_ensemble_it_checks_and_warns_of_the_default_guess() -> None:
    ours = choice.ZkChoice("h:1", "your ensemble of 3 servers, Slurm job 12")
    assert doctor.source_check(ours).level is doctor.Level.PASS
    guess = doctor.source_check(choice.ZkChoice(contract.DEFAULT_ZK, choice.DEFAULT_SOURCE))
    assert guess.level is doctor.Level.WARN
    assert "hpc-elastic zk start" in guess.hint


def test_doctor_fails_an_ensemble_without_a_leader_and_warns_of_a_degraded_one() -> None:
    leader, follower = fourletter.Health("a:1", "leader"), fourletter.Health("b:1", "follower")
    down = fourletter.Health("c:1", "down")
    assert doctor.quorum_rule([leader, follower, follower]).level is doctor.Level.PASS
    degraded = doctor.quorum_rule([leader, follower, down])
    assert degraded.level is doctor.Level.WARN
    assert "2 of 3 servers serving (c:1 down)" in degraded.message
    assert "survives 0 more lost server(s)" in degraded.hint
    looking = fourletter.Health("b:1", "no quorum")
    assert doctor.quorum_rule([looking, looking, down]).level is doctor.Level.FAIL


def test_doctor_warns_when_the_agents_session_is_outside_the_servers_bounds() -> None:
    assert doctor.session_rule(6.0, (2.0, 60.0)).level is doctor.Level.PASS
    short = doctor.session_rule(2.0, (4.0, 40.0))
    assert short.level is doctor.Level.WARN
    assert "so they get 4 s" in short.message
    assert doctor.session_rule(6.0, None).message.startswith("not checked")
    conf = "clientPort=2181\nminSessionTimeout=4000\nmaxSessionTimeout=40000\n"
    assert doctor.parse_conf_bounds(conf) == (4.0, 40.0)


def test_doctor_fails_an_ensemble_that_does_not_enforce_acls() -> None:
    assert doctor.acl_rule(True).level is doctor.Level.PASS
    assert doctor.acl_rule(False).level is doctor.Level.FAIL
    assert doctor.acl_rule(None).level is doctor.Level.WARN


def test_the_help_loads_nothing_of_the_ensemble_but_what_choosing_one_needs() -> None:
    """``hpc-elastic --help`` and ``zk --help`` list the commands; the search for Java, the
    servers and the Slurm side load only when a ``zk`` command runs."""
    for args in (["--help"], ["zk", "--help"], ["zk", "start", "--help"]):
        result = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "hpc_elastic", *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        )
        imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines()}
        for module in ("install", "server", "lifecycle", "supervisor", "admin"):
            assert f"hpc_elastic.ensemble.{module}" not in imported, args
        assert "kazoo" not in imported


# --- zk serve: the same server in the foreground ------------------------------------------------


def test_zk_serve_serves_in_the_foreground_until_zk_stop_ends_it(tmp_path: Path) -> None:
    """No Slurm: one standalone server of the user's, which ``zk status`` shows and ``zk stop``
    ends (SIGTERM), leaving no file, data directory or listening port behind."""
    if not testing.ZOOKEEPER_JAR.exists():
        message = f"ZooKeeper is not installed ({testing.ZOOKEEPER_JAR} is missing)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{message}; CI must test against a real ZooKeeper", pytrace=False)
        pytest.skip(message)
    local = tmp_path / "local"
    local.mkdir()
    env = {
        **os.environ,
        contract.STATE_DIR_ENV: str(tmp_path / "state"),
        "TMPDIR": str(local),
        "PYTHONPATH": str(Path(__file__).parents[2]),
    }
    env.pop(contract.ZK_ENV, None)
    layout = Layout(tmp_path / "state" / "zk")
    command = [sys.executable, "-m", "hpc_elastic", "zk"]
    server = subprocess.Popen(
        [*command, "serve"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert wait_until(layout.ensemble_file.exists, 120), server.poll()
        shown = subprocess.run(
            [*command, "status", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        status = json.loads(shown.stdout)
        assert status["state"] == "serving", status
        (served,) = status["servers"]
        assert served["mode"] == "standalone"
        [data] = local.glob("hpc-elastic-zk-serve-*")
        assert data.stat().st_mode & 0o777 == 0o700
        stopped = subprocess.run(
            [*command, "stop"], env=env, capture_output=True, text=True, timeout=120, check=False
        )
        assert stopped.returncode == 0, stopped.stderr
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert not layout.ensemble_file.exists()
    assert list(local.glob("hpc-elastic-zk-serve-*")) == []
    assert fourletter.health("127.0.0.1", served["client_port"], timeout=1.0).mode == "down"


# --- losing a server: spares, a replacement and the reconfiguration --------------------------


def test_zk_start_refuses_spares_for_one_server_before_asking_slurm(
    layout: Layout, machine: Path
) -> None:
    with mocked_slurm() as fake:
        result = CliRunner().invoke(cli.app, ["zk", "start", "--servers", "1", "--spares", "1"])
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: --spares 1 needs --servers 3 or 5")
    assert fake.calls == []
    assert lifecycle.spares_refusal(3, 3) is not None
    assert "--spares '3' is not one of 0..2" in str(lifecycle.spares_refusal(3, 3))
    assert lifecycle.spares_refusal(3, 1) is None
    assert lifecycle.spares_refusal(1, 0) is None


def test_with_a_superuser_zoo_cfg_turns_reconfiguration_on_and_lists_a_joiner_as_observer() -> None:
    digest = zoocfg.super_digest("s3cret")
    joiner = peer(4)
    config = zoocfg.ServerConfig(
        4, "/l/d", "/l/t", 21004, (peer(1), peer(2), peer(3)), (joiner,), digest
    )
    lines = zoocfg.render_zoo_cfg(config).splitlines()
    assert "reconfigEnabled=true" in lines
    assert f"DigestAuthenticationProvider.superDigest={digest}" in lines
    assert "skipACL=no" in lines
    assert [line for line in lines if line.startswith("server.")] == [
        "server.1=10.0.0.1:22001:23001:participant;21001",
        "server.2=10.0.0.2:22002:23002:participant;21002",
        "server.3=10.0.0.3:22003:23003:participant;21003",
        "server.4=10.0.0.4:22004:23004:observer;21004",
    ]
    without = zoocfg.render_zoo_cfg(zoocfg.ServerConfig(1, "/d", "/t", 1, (peer(1),)))
    assert "reconfigEnabled=false" in without.splitlines()
    assert "superDigest" not in without


def test_the_superusers_digest_is_the_one_a_client_with_the_secret_presents() -> None:
    from kazoo.security import make_digest_acl_credential  # noqa: PLC0415

    from hpc_elastic.rendezvous import zookeeper  # noqa: PLC0415

    assert zoocfg.SUPERUSER == zookeeper.DIGEST_USER  # its client with the secret is the superuser
    assert zoocfg.super_digest("s3cret") == make_digest_acl_credential(zoocfg.SUPERUSER, "s3cret")


ZOOKEEPERS_DYNAMIC_FILE = (
    "server.1=127.0.0.1:29111:29112:participant;0.0.0.0:29110\n"
    "server.2=127.0.0.1:29121:29122:participant;0.0.0.0:29120\n"
    "server.4=127.0.0.1:29141:29142:observer;0.0.0.0:29140\n"
    "version=200000002\n"
)


def test_the_members_of_a_dynamic_configuration_and_what_a_reconfig_must_still_do() -> None:
    members = zoocfg.dynamic_members(ZOOKEEPERS_DYNAMIC_FILE)
    assert members == {1: "participant", 2: "participant", 4: "observer"}
    assert zoocfg.dynamic_members("server.3=h:1:2\n") == {3: "participant"}
    assert admin.needed(members, joiner=4, leaving=3) == (True, False)
    assert admin.needed({1: "participant", 4: "participant"}, joiner=4, leaving=3) == (
        False,
        False,
    )
    assert admin.needed({1: "participant", 3: "participant"}, joiner=4, leaving=3) == (True, True)


def test_a_server_started_again_keeps_zookeepers_configuration_only_while_it_lists_it() -> None:
    zoo_cfg = "tickTime=1000\ndynamicConfigFile=/d/zoo.cfg.dynamic.200000002\n"

    def dynamic(path: str) -> str | None:
        return ZOOKEEPERS_DYNAMIC_FILE if path == "/d/zoo.cfg.dynamic.200000002" else None

    assert zoocfg.zookeeper_owns(zoo_cfg, dynamic, 2)
    assert not zoocfg.zookeeper_owns(zoo_cfg, dynamic, 4)  # a joiner not added yet
    assert not zoocfg.zookeeper_owns(zoo_cfg, dynamic, 3)  # a server removed meanwhile
    assert not zoocfg.zookeeper_owns(zoo_cfg, lambda path: None, 2)
    assert not zoocfg.zookeeper_owns("server.2=h:1:2\n", dynamic, 2)  # ours: never split yet


def test_a_joiner_counts_as_synced_once_it_follows_the_leader_in_broadcast() -> None:
    assert fourletter.synced(
        {"zk_server_state": "follower", "zk_peer_state": "following - broadcast"}
    )
    assert not fourletter.synced(
        {"zk_server_state": "follower", "zk_peer_state": "following - sync"}
    )
    assert not fourletter.synced({"zk_peer_state": "looking - discovery"})
    assert fourletter.synced({"zk_server_state": "follower"})  # before 3.6: no peer state


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("s1", ["s1"]),
        ("s[1-2,4]", ["s1", "s2", "s4"]),
        ("gpu[08-10],login1", ["gpu08", "gpu09", "gpu10", "login1"]),
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("", []),
    ],
)
def test_slurms_compact_node_lists_expand_as_scontrol_show_hostnames_does(
    text: str, names: list[str]
) -> None:
    assert supervisor.expand_nodelist(text) == names


def test_the_batch_host_is_the_spare_used_last_and_runs_the_last_server_without_spares() -> None:
    nodes = ["s1", "s2", "s3", "s4"]
    assert supervisor.place(nodes, "s1", 3) == (["s2", "s3", "s4"], ["s1"])
    assert supervisor.place(["s1", "s2", "s3", "s4", "s5"], "s1", 3) == (
        ["s2", "s3", "s4"],
        ["s5", "s1"],
    )
    assert supervisor.place(["s1", "s2", "s3"], "s1", 3) == (["s2", "s3", "s1"], [])
    with pytest.raises(EnsembleError, match=r"has 2 node\(s\) \(s2, s1\) for 3 servers"):
        supervisor.place(["s1", "s2"], "s1", 3)


def ended(**change: object) -> supervisor.Ended:
    base = supervisor.Ended(
        code=137,
        node_in_job=True,
        stopping=False,
        tries=0,
        restarts=3,
        served=True,
        servers=3,
        spare="s4",
    )
    return dataclasses.replace(base, **change)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "kind", "why"),
    [
        ({}, "restart", "its step ended with 137"),
        ({"stopping": True, "node_in_job": False}, "done", "the ensemble is stopping"),
        ({"code": 0}, "done", "it stopped on request"),
        ({"code": 0, "node_in_job": False}, "replace", "its node left the job"),
        ({"node_in_job": False, "tries": 0}, "replace", "its node left the job"),
        ({"tries": 3}, "replace", "after 3 start(s) in place"),
        ({"code": server_module.CANNOT_START}, "replace", "it cannot start on its node"),
        ({"node_in_job": False, "spare": None}, "give up", "no spare node is left"),
        ({"node_in_job": False, "served": False}, "give up", "the ensemble never served"),
        ({"node_in_job": False, "servers": 1}, "give up", "one server alone has no quorum"),
    ],
)
def test_after_a_servers_step_ends_the_supervisor_restarts_replaces_or_lets_it_be(
    change: dict[str, object], kind: str, why: str
) -> None:
    """srun exits 0 when its node fails, so only the job's node list tells a lost node from
    a stop on request."""
    action = supervisor.after_exit(ended(**change))
    assert action.kind == kind
    assert why in action.why
    if kind == "replace":
        assert action.node == "s4"


def test_a_replacement_takes_the_lost_servers_place_and_old_connect_strings_still_name_it() -> None:
    old = an_ensemble("12")
    joiner = dataclasses.replace(peer(4), replaces=2)
    new = supervisor.replaced(old, joiner, 2)
    assert [server.myid for server in new.servers] == [1, 3, 4]
    assert new.retired == (peer(2),)
    assert new.connect == "10.0.0.1:21001,10.0.0.3:21003,10.0.0.4:21004"
    assert new.names(old.connect + "/team")  # a job submitted before the loss
    assert new.names(new.connect)
    assert not new.names("10.0.0.2:21002")  # only the lost server: no member left in it
    assert not new.names(old.connect + ",elsewhere:2181")
    before = Record("train-1", "20", old.connect)
    assert lifecycle.users_of(new, [before]) == [before]
    path = Path("/x/ensemble.json")
    assert files.decode_ensemble(files.encode(new), path) == new
    record = StartRecord(3, "/j", "/c", spares=1)
    assert files.decode_start(files.encode(record), path) == record


def test_zk_status_shows_a_joiner_the_replaced_server_and_the_spares_left() -> None:
    ensemble = supervisor.replaced(
        an_ensemble("12"), dataclasses.replace(peer(4), replaces=2, node="s4"), 2
    )
    leader = fourletter.Health("a", "leader", 2)
    view = lifecycle.StatusView(
        ensemble,
        StartRecord(3, "/j", "/c", job_id="12", spares=1),
        "RUNNING",
        [
            lifecycle.ServerView(ensemble.servers[0], leader, "12.0 RUNNING"),
            lifecycle.ServerView(ensemble.servers[1], fourletter.Health("c", "follower"), "-"),
            lifecycle.ServerView(ensemble.servers[2], fourletter.Health("d", "follower"), "-"),
            lifecycle.ServerView(
                dataclasses.replace(peer(5), replaces=1),
                fourletter.Health("e", "follower"),
                "-",
                True,
            ),
        ],
        "serving",
        [],
        Path("/f"),
        [],
        [],
    )
    text = "\n".join(lifecycle.render(view))
    assert "Servers   3 of 3 serving" in text
    assert "Spares    none left" in text
    assert "Replaced  server 2 (s2, 10.0.0.2:21002) by server 4 on s4" in text
    assert re.search(r"^  5 \(for 1\) +s5 .* joining \(follower\)", text, re.M), text
    assert view.to_json()["retired"][0]["myid"] == 2
    assert lifecycle.supervisor_lost("s1", ["s2", "s3"]) is not None
    assert lifecycle.supervisor_lost("s1", ["s1", "s2"]) is None


def test_the_last_step_removes_every_server_directory_of_the_job_and_nothing_else(
    layout: Layout, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    files.ensure_private_dir(layout.run_dir)
    files.write_private(
        layout.start_file, files.encode(StartRecord(3, "/j", "/c", data_root=str(local)))
    )
    for name in (
        "hpc-elastic-zk-41-1",
        "hpc-elastic-zk-41-4",
        "hpc-elastic-zk-410-1",
        "hpc-elastic-zk-41-x",
    ):
        server_module.make_data_dir(local / name, reuse=False)
    server_module.clean_node(layout, {"SLURM_JOB_ID": "41"})
    assert sorted(path.name for path in local.iterdir()) == [
        "hpc-elastic-zk-41-x",
        "hpc-elastic-zk-410-1",
    ]


@dataclass
class LocalServers:
    """Real ZooKeeper servers on this host, configured as the ensemble's job configures them
    (``server.write_config``, ``kept_config``, ``launch``), without Slurm."""

    root: Path
    secret: str
    servers: dict[int, Server] = field(default_factory=dict)
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        found = install.find_installation()
        self.start = StartRecord(3, found.java, found.classpath, heap="128m")
        claims = server_module.PortClaim()
        candidates = zoocfg.port_candidates(contract.DEFAULT_ZK_PORTS, random.Random())
        ports = zoocfg.choose_ports(12, candidates, claims.claim)
        claims.release()
        for myid in (1, 2, 3, 4):
            client, quorum, election = ports[3 * myid - 3 : 3 * myid]
            self.servers[myid] = Server(myid, "127.0.0.1", client, quorum, election)

    def launch(self, myid: int, members: list[int], joining: bool, reuse: bool = False) -> None:
        directory = server_module.make_data_dir(self.root / f"zk-{myid}", reuse=reuse)
        cfg = server_module.kept_config(directory, myid) if reuse else None
        cfg = cfg or server_module.write_config(
            directory,
            zoocfg.ServerConfig(
                myid,
                str(directory / "data"),
                str(directory / "txlog"),
                self.servers[myid].client_port,
                [self.servers[member] for member in members],
                [self.servers[myid]] if joining else [],
                zoocfg.super_digest(self.secret),
            ),
        )
        with open(self.root / f"zk-{myid}.log", "ab") as output:
            self.processes[myid] = server_module.launch(self.start, cfg, output.fileno())

    def kill(self, myid: int) -> None:
        self.processes[myid].kill()
        self.processes[myid].wait()

    def mode(self, myid: int) -> str:
        server = self.servers[myid]
        return fourletter.health(server.host, server.client_port, timeout=1.0).mode

    def synced(self, myid: int) -> bool:
        server = self.servers[myid]
        try:
            answer = fourletter.ask(server.host, server.client_port, "mntr", 1.0)
        except OSError:
            return False
        return fourletter.synced(fourletter.parse_mntr(answer))

    def one_leader(self, myids: list[int]) -> bool:
        modes = sorted(map(self.mode, myids))
        return modes.count("leader") == 1 and modes.count("follower") == len(myids) - 1

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def test_a_joiner_replaces_a_lost_leader_by_the_superusers_reconfig_and_no_one_elses(
    tmp_path: Path,
) -> None:
    """Real ZooKeeper servers, configured as the ensemble's job configures them, without
    Slurm: the leader of three is killed; a fourth server starts as a joiner (the members and
    itself as an observer), syncs, and the superuser's reconfig makes it a member in the lost
    leader's place; a client with another secret is refused. Started again in place, the new
    member keeps the configuration ZooKeeper wrote for it, and rejoins."""
    if not testing.ZOOKEEPER_JAR.exists():
        message = f"ZooKeeper is not installed ({testing.ZOOKEEPER_JAR} is missing)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{message}; CI must test against a real ZooKeeper", pytrace=False)
        pytest.skip(message)
    local = LocalServers(tmp_path, "the-superusers-secret")
    try:
        for myid in (1, 2, 3):
            local.launch(myid, [1, 2, 3], joining=False)
        assert wait_until(lambda: local.one_leader([1, 2, 3]), 180)
        leader = next(myid for myid in (1, 2, 3) if local.mode(myid) == "leader")
        local.kill(leader)
        survivors = [myid for myid in (1, 2, 3) if myid != leader]
        assert wait_until(lambda: local.one_leader(survivors), 60)

        local.launch(4, [1, 2, 3], joining=True)
        assert wait_until(lambda: local.synced(4), 120)
        joiner = local.servers[4]
        ensemble = Ensemble(servers=tuple(local.servers[myid] for myid in (1, 2, 3)), job_id="9")
        with pytest.raises(EnsembleError, match="NoAuthError"):
            admin.replace_member(ensemble, joiner, leader, "another-secret", 60)
        members = admin.replace_member(ensemble, joiner, leader, local.secret, 120)
        assert members == {**dict.fromkeys(survivors, "participant"), 4: "participant"}
        assert wait_until(lambda: local.one_leader([*survivors, 4]), 60)

        local.kill(4)
        assert server_module.kept_config(tmp_path / "zk-4", 4) is not None
        local.launch(4, [1, 2, 3], joining=False, reuse=True)
        assert wait_until(lambda: local.mode(4) == "follower", 120), (
            tmp_path / "zk-4.log"
        ).read_text()[-2000:]
    finally:
        local.stop()


def test_the_supervisor_restarts_in_place_then_replaces_on_the_spare_then_gives_up(
    layout: Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor's loop on the real rules, its steps short shell processes in place of
    srun: server 3 fails twice on its node (one start in place, --restarts 1), so a server 4
    starts on the spare node in its place; server 2's node then leaves the job, and with no
    spare left it stays down; server 1 and the replacement stop on request."""
    for name in ("POLL_S", "RESTART_PAUSE_S", "CONFIRM_S"):
        monkeypatch.setattr(supervisor, name, 0.01)
    publish(layout, dataclasses.replace(an_ensemble("7"), run_dir=str(layout.run_dir)))
    files.ensure_private_dir(layout.run_dir)
    nodes = {"s1", "s2", "s3", "s4"}
    exits = {1: [0], 2: [1], 3: [1, 1], 4: [0]}
    started: list[tuple[int, str, str]] = []
    flag = layout.run_dir / "server-2-may-end"

    def spawn(argv: list[str], environ: dict[str, str]) -> subprocess.Popen[bytes]:
        myid = int(argv[argv.index("--myid") + 1])
        node = next(arg for arg in argv if arg.startswith("--nodelist=")).split("=")[1]
        started.append((myid, node, environ.get(server_module.REPLACES_ENV, "")))
        code = exits[myid].pop(0)
        if myid == 4:  # server 3's story is told: server 2's node is lost, its step ends
            nodes.discard("s3")
            flag.touch()
        wait = f"until [ -e {flag} ]; do sleep 0.05; done; " if myid == 2 else ""
        return subprocess.Popen(["sh", "-c", f"{wait}sleep 0.1; exit {code}"])

    said: list[str] = []
    run = supervisor.Supervisor(
        layout,
        StartRecord(3, "/j", "/c", restarts=1, spares=1),
        "7",
        ["s1"],
        lambda: set(nodes),
        say=said.append,
        spawn=spawn,
    )
    assert run.run(["s2", "s3", "s4"]) == 0
    assert sorted(started) == [
        (1, "s2", ""),
        (2, "s3", ""),
        (3, "s4", ""),
        (3, "s4", ""),
        (4, "s1", "3"),
    ]
    text = "\n".join(said)
    assert "server 3 on s4: its step ended with 1; starting it again in place (1 of 1)" in text
    assert "server 4 starts on the spare node s1 to take its place" in text
    assert (
        "server 2 on s3: its node left the job (lost), and no spare node is left "
        "(zk start --spares); it stays down"
    ) in text
