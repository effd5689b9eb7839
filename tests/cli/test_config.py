"""Config-file defaults: where they are found, how values are checked, who wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_elastic.config import ZK_ENV, find_config, load_config, unsafe_config_reason
from hpc_elastic.errors import ConfigError
from hpc_elastic.spec import NodeRange, PreemptSignal


def test_no_file_means_no_defaults(tmp_path: Path) -> None:
    config = load_config(tmp_path, environ={})
    assert config.path is None
    assert dict(config.values) == {}


def test_hpc_elastic_toml_is_found_from_a_subdirectory(tmp_path: Path) -> None:
    (tmp_path / "hpc-elastic.toml").write_text('nodes = "1:4"\npartition = "gpu"\n')
    deep = tmp_path / "src" / "pkg"
    deep.mkdir(parents=True)
    config = load_config(deep, environ={})
    assert config.path == tmp_path / "hpc-elastic.toml"
    assert config.values == {"nodes": NodeRange(1, 4), "partition": "gpu"}


def test_pyproject_counts_only_with_a_tool_table(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert find_config(tmp_path) is None
    (tmp_path / "pyproject.toml").write_text("[tool.hpc-elastic]\nnodes = 2\n")
    assert find_config(tmp_path) == tmp_path / "pyproject.toml"
    assert load_config(tmp_path, environ={}).values == {"nodes": NodeRange(2, 2)}


@pytest.mark.parametrize("marker", [".git", "pyproject.toml"])
def test_a_file_planted_above_the_project_root_is_never_read(tmp_path: Path, marker: str) -> None:
    (tmp_path / "hpc-elastic.toml").write_text('setup = ["touch /tmp/pwned"]\n')
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    if marker == ".git":
        (project / ".git").mkdir()
    else:
        (project / marker).write_text('[project]\nname = "x"\n')
    assert find_config(project / "src") is None
    assert load_config(project / "src", environ={}).values == {}


def test_a_file_planted_above_home_is_never_read(tmp_path: Path) -> None:
    (tmp_path / "hpc-elastic.toml").write_text('setup = ["touch /tmp/pwned"]\n')
    home = tmp_path / "home" / "ada"
    (home / "work").mkdir(parents=True)
    assert find_config(home / "work", home=home) is None
    (home / "hpc-elastic.toml").write_text("nodes = 2\n")
    assert find_config(home / "work", home=home) == home / "hpc-elastic.toml"


def test_a_config_file_of_another_user_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "hpc-elastic.toml"
    path.write_text('setup = ["touch /tmp/pwned"]\n')
    path.chmod(0o644)
    someone_else = path.stat().st_uid + 1000
    with pytest.raises(
        ConfigError, match=f"^Config file '{path}' is not trusted because it is owned by user id"
    ) as caught:
        load_config(tmp_path, environ={}, uid=someone_else)
    assert "chmod go-w" in str(caught.value)


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666])
def test_a_config_file_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "hpc-elastic.toml"
    path.write_text("nodes = 2\n")
    path.chmod(mode)
    with pytest.raises(ConfigError, match=f"group or others may write it \\(mode 0{mode:o}\\)"):
        load_config(tmp_path, environ={})


def test_only_a_file_of_ones_own_that_only_one_may_write_is_trusted() -> None:
    assert unsafe_config_reason(owner=1234, mode=0o100600, uid=1234) is None
    assert unsafe_config_reason(owner=1234, mode=0o100644, uid=1234) is None
    assert unsafe_config_reason(owner=0, mode=0o100644, uid=1234) is not None
    assert unsafe_config_reason(owner=1234, mode=0o100620, uid=1234) is not None


def test_nearest_file_wins(tmp_path: Path) -> None:
    (tmp_path / "hpc-elastic.toml").write_text("nodes = 8\n")
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "pyproject.toml").write_text("[tool.hpc-elastic]\nnodes = 2\n")
    assert find_config(inner) == inner / "pyproject.toml"


def test_every_kind_of_value_is_converted(tmp_path: Path) -> None:
    (tmp_path / "hpc-elastic.toml").write_text(
        """
nodes = "2:8"
nproc-per-node = 4
time = 90
mem = "64G"
requeue = false
signal = "USR1@120"
setup = ["module load cuda"]
env = { OMP_NUM_THREADS = 8, NCCL_DEBUG = "WARN" }
log-dir = "runs"
template = "~/my.sh.j2"
sbatch-args = ["--reservation=big"]
min-wait = 30
"""
    )
    values = load_config(tmp_path, environ={}).values
    assert values["nodes"] == NodeRange(2, 8)
    assert values["time"] == "90"
    assert values["requeue"] is False
    assert values["signal"] == PreemptSignal("USR1", 120)
    assert values["setup"] == ("module load cuda",)
    assert values["env"] == (("OMP_NUM_THREADS", "8"), ("NCCL_DEBUG", "WARN"))
    assert values["log_dir"] == tmp_path / "runs"
    assert values["template"] == Path.home() / "my.sh.j2"
    assert values["sbatch_args"] == ("--reservation=big",)
    assert values["min_wait"] == 30.0


def test_environment_zk_beats_the_file(tmp_path: Path) -> None:
    (tmp_path / "hpc-elastic.toml").write_text('zk = "file:2181"\n')
    assert load_config(tmp_path, environ={ZK_ENV: "env:2181"}).values["zk"] == "env:2181"
    with pytest.raises(ConfigError, match=f"^{ZK_ENV}: --zk 'nope' is not"):
        load_config(tmp_path, environ={ZK_ENV: "nope"})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nodes = [", "is not valid TOML"),
        ('partitoin = "gpu"', "unknown key 'partitoin'; use one of"),
        ('nproc-per-node = "4"', "key 'nproc-per-node' must be an integer, not str '4'"),
        ("requeue = 1", "key 'requeue' must be true or false, not int 1"),
        ("nproc-per-node = true", "key 'nproc-per-node' must be an integer, not bool"),
        ('nodes = "4:1"', "key 'nodes' is invalid: --nodes '4:1' is inverted"),
        ('setup = "module load x"', "key 'setup' must be a list of strings"),
        ("env = { A = true }", "key 'env' must be a table"),
        ('time = "soon"', "key 'time' is invalid: --time 'soon' is not a Slurm time"),
    ],
)
def test_malformed_files_name_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "hpc-elastic.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=f"^{path}") as caught:
        load_config(tmp_path, environ={})
    assert message in str(caught.value)
