"""Config-file defaults: where they are found, how values are checked, who wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_elastic.config import ZK_ENV, find_config, load_config
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
    (tmp_path / "pyproject.toml").write_text("[tool.hpc-elastic]\nnodes = 2\n")
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert find_config(inner) == tmp_path / "pyproject.toml"
    assert load_config(inner, environ={}).values == {"nodes": NodeRange(2, 2)}


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
