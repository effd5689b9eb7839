"""The parsers behind every flag and config key: good values pass, bad ones say what to do."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc_elastic.errors import UsageError
from hpc_elastic.options import agent_options
from hpc_elastic.spec import (
    JobSpec,
    NodeRange,
    PreemptSignal,
    parse_container_mount,
    parse_env,
    parse_job_name,
    parse_mem,
    parse_sbatch_arg,
    parse_setup_line,
    parse_time,
    parse_zk,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4", NodeRange(4, 4)), ("1:4", NodeRange(1, 4)), (" 2 : 8 ", NodeRange(2, 8))],
)
def test_node_range_parses_fixed_and_elastic(text: str, expected: NodeRange) -> None:
    assert NodeRange.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "quoted"),
    [("4:1", "'4:1' is inverted"), ("0", "'0' asks for fewer"), ("a:b", "'a:b' is not")],
)
def test_node_range_rejects_bad_counts(text: str, quoted: str) -> None:
    with pytest.raises(UsageError, match=quoted):
        NodeRange.parse(text)


@given(st.integers(1, 10_000), st.integers(0, 10_000))
def test_node_range_round_trips_through_text(low: int, extra: int) -> None:
    nodes = NodeRange(low, low + extra)
    assert NodeRange.parse(str(nodes)) == nodes
    assert nodes.is_elastic == (extra > 0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("USR2@90", PreemptSignal("USR2", 90)),
        ("SIGUSR1@120", PreemptSignal("USR1", 120)),
        ("term", PreemptSignal("TERM", 60)),
    ],
)
def test_signal_parses_name_and_grace(text: str, expected: PreemptSignal) -> None:
    assert PreemptSignal.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "quoted"),
    [
        ("B:USR2@90", "only the batch shell"),
        ("KILL@10", "'KILL' is not a signal the agent can catch"),
        ("USR2@soon", "'USR2@soon' is not SIGNAL"),
    ],
)
def test_signal_rejects_what_the_agents_would_not_get(text: str, quoted: str) -> None:
    with pytest.raises(UsageError, match=quoted):
        PreemptSignal.parse(text)


@pytest.mark.parametrize(
    "text", ["30", "30:00", "2:00:00", "1-12", "1-12:30", "1-12:30:00", "UNLIMITED"]
)
def test_time_accepts_every_slurm_format(text: str) -> None:
    assert parse_time(text) == text


@pytest.mark.parametrize("text", ["", "1h", "1:2:3:4", "1-", "-5", "1-2-3"])
def test_time_rejects_other_text(text: str) -> None:
    with pytest.raises(UsageError, match=f"--time '{text}' is not a Slurm time"):
        parse_time(text)


@pytest.mark.parametrize(("text", "expected"), [("64G", "64G"), ("500m", "500M"), ("0", "0")])
def test_mem_accepts_sbatch_sizes(text: str, expected: str) -> None:
    assert parse_mem(text) == expected


@pytest.mark.parametrize("text", ["", "4X", "1.5G", "-1G", "G"])
def test_mem_rejects_other_text(text: str) -> None:
    with pytest.raises(UsageError, match="is not a memory size"):
        parse_mem(text)


def test_env_splits_at_the_first_equals_sign() -> None:
    assert parse_env("OPTS=a=b c") == ("OPTS", "a=b c")


@pytest.mark.parametrize("text", ["NOVALUE", "1A=b", "A-B=c", "=x"])
def test_env_rejects_what_is_not_a_shell_assignment(text: str) -> None:
    with pytest.raises(UsageError, match="is not KEY=VALUE"):
        parse_env(text)


@pytest.mark.parametrize("text", ["zk1:2181", "a:1,b.example.org:2182", "h:2181/hpc/elastic"])
def test_zk_accepts_ensembles_and_chroots(text: str) -> None:
    assert parse_zk(text) == text


@pytest.mark.parametrize("text", ["zk1", "zk1:", "a:1,,b:2", "a:1/", "a:1/x y", "a:1;id"])
def test_zk_rejects_other_text(text: str) -> None:
    with pytest.raises(UsageError, match="is not a ZooKeeper address list"):
        parse_zk(text)


def test_job_name_must_be_path_and_shell_safe() -> None:
    assert parse_job_name("train-v2.1_a") == "train-v2.1_a"
    with pytest.raises(UsageError, match="--job-name 'a/b' is not usable"):
        parse_job_name("a/b")


def test_sbatch_arg_must_be_one_option() -> None:
    assert parse_sbatch_arg("--reservation=big") == "--reservation=big"
    with pytest.raises(UsageError, match="is not an sbatch option"):
        parse_sbatch_arg("reservation=big")
    with pytest.raises(UsageError, match="contains spaces or control characters"):
        parse_sbatch_arg("--comment=a\n#SBATCH --x")


@pytest.mark.parametrize(
    ("text", "instead"),
    [
        ("--array=0-7", "--nodes MIN:MAX"),
        ("-N2", "--nodes"),
        ("--output=x", "--log-dir"),
        ("--arr=0-7", "--nodes MIN:MAX"),
        ("--outp=x", "--log-dir"),
        ("--no-k", "--nodes"),
        ("-kN4", "--nodes"),
        ("-Hk", "--nodes"),
        ("-pgpu", "--partition"),
        ("--part=gpu", "--partition"),
        ("--ti=5", "--time"),
        ("--sig=USR1", "--signal"),
        ("--wr=id", "SCRIPT"),
        ("-Jname", "--job-name"),
        ("--gpus-per=2", "--gpus-per-node"),
    ],
)
def test_sbatch_arg_may_not_reshape_the_job(text: str, instead: str) -> None:
    """sbatch takes any unambiguous abbreviation and grouped short flags (getopt_long)."""
    with pytest.raises(UsageError, match=f"which hpc-elastic decides itself; use {instead}"):
        parse_sbatch_arg(text)


@pytest.mark.parametrize(
    "text",
    [
        "--gpus=8",
        "--reservation=big",
        "--res=big",
        "--time-min=10",
        "--mem-per-cpu=4G",
        "--nodelist=n1",
        "-wn1",
        "-H",
        "--mail-type=END",
        "--comment=a#b'c\"d\\e",
    ],
)
def test_sbatch_args_that_shape_nothing_pass_through(text: str) -> None:
    assert parse_sbatch_arg(text) == text


def test_setup_line_is_one_line() -> None:
    assert parse_setup_line("module load cuda/12") == "module load cuda/12"
    with pytest.raises(UsageError, match="give one --setup per shell line"):
        parse_setup_line("module load cuda\nrm -rf ~")


@pytest.mark.parametrize(
    ("field", "value", "quoted"),
    [
        ("nproc_per_node", 0, "--nproc-per-node '0' is out of range"),
        ("max_restarts", -1, "--max-restarts '-1' is out of range"),
        ("partition", "gpu\n#SBATCH --uid=0", "--partition"),
        ("account", "a b", "--account 'a b'"),
        ("log_dir", Path("/my runs"), "--log-dir '/my runs' contains spaces"),
        ("min_wait", -1.0, "--min-wait '-1.0' is negative"),
        # Every option's value is held to its flag's rule, those the checks once skipped too:
        ("keep", 0, "--keep '0' is out of range"),
        ("expected_gpus", -1, "--expected-gpus '-1' is out of range"),
        ("bad_node_ttl", -1.0, "--bad-node-ttl '-1.0' is negative"),
        ("grace_action", "later", "--grace-action 'later' is not one of warn, lead, local"),
        ("notify", "ftp://hooks.example.com", "--notify 'ftp://hooks.example.com' is not an"),
    ],
)
def test_job_spec_validates_itself(field: str, value: object, quoted: str) -> None:
    with pytest.raises(UsageError, match=quoted):
        JobSpec(script=Path("/train.py"), **{field: value})  # type: ignore[arg-type]


# --- containers (issue 14) -----------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["/datasets", "/datasets:/data", "/datasets:/data:ro+rprivate", "/a,/b:/c:ro"]
)
def test_a_container_mount_is_src_dst_flags_with_absolute_paths(text: str) -> None:
    assert parse_container_mount(text) == text


@pytest.mark.parametrize(
    "text", ["", "datasets", "/a:data", "/a,b", "/a,", "/a:/b:ro:x", "/my data", "/a\n/b"]
)
def test_a_container_mount_pyxis_or_apptainer_would_misread_is_refused_quoted(text: str) -> None:
    with pytest.raises(UsageError, match=r"--container-mounts .* is not SRC\[:DST\[:FLAGS\]\]"):
        parse_container_mount(text)


def test_two_container_runtimes_for_one_job_are_one_sentence_naming_both() -> None:
    with pytest.raises(UsageError) as caught:
        JobSpec(script=Path("/train.py"), container_image="pytorch", apptainer="/i.sif")
    assert str(caught.value) == (
        "--container-image 'pytorch' and --apptainer '/i.sif' are two container runtimes for "
        "one job; give only one."
    )


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("container_mounts", ("/data",), "--container-mounts '/data' applies inside a container"),
        ("container_python", "python3.11", "--container-python 'python3.11' applies inside"),
    ],
)
def test_container_settings_without_an_image_say_which_flag_adds_one(
    field: str, value: object, said: str
) -> None:
    with pytest.raises(UsageError, match=said) as caught:
        JobSpec(script=Path("/train.py"), **{field: value})  # type: ignore[arg-type]
    assert "add --container-image IMAGE (pyxis) or --apptainer IMAGE" in str(caught.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [("container_image", "nvcr.io#nvidia/pytorch 24"), ("apptainer", ""), ("container_python", "")],
)
def test_an_image_or_interpreter_must_be_one_word(field: str, value: str) -> None:
    image = {} if field != "container_python" else {"apptainer": "/i.sif"}
    with pytest.raises(UsageError, match="contains spaces or control characters; give one word"):
        JobSpec(script=Path("/train.py"), **{**image, field: value})  # type: ignore[arg-type]


def test_a_node_local_checkpoint_dir_must_be_mounted_where_the_workers_write() -> None:
    with pytest.raises(UsageError, match="add --container-mounts /local/ckpt"):
        JobSpec(
            script=Path("/train.py"), apptainer="/i.sif", local_checkpoint_dir=Path("/local/ckpt")
        )
    mounted = JobSpec(
        script=Path("/train.py"),
        container_image="pytorch",
        container_mounts=("/datasets,/tmp/node-local:/local",),
        local_checkpoint_dir=Path("/local/ckpt"),
    )
    assert mounted.container == "pyxis"


def test_grace_action_local_needs_a_node_local_checkpoint_dir() -> None:
    with pytest.raises(UsageError, match=r"--grace-action 'local' .* add --local-checkpoint-dir"):
        JobSpec(script=Path("/train.py"), grace_action="local")
    spec = JobSpec(
        script=Path("/train.py"), grace_action="local", local_checkpoint_dir=Path("/local/ckpt")
    )
    assert agent_options({"grace_action": spec.grace_action}) == (("--grace-action", "local"),)
    with pytest.raises(UsageError, match=r"--signal is 'TERM@90', .* give e\.g\. --signal USR2@90"):
        JobSpec(
            script=Path("/train.py"),
            grace_action="local",
            local_checkpoint_dir=Path("/local/ckpt"),
            signal=PreemptSignal("TERM", 90),
        )
