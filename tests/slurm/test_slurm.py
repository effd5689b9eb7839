"""The Slurm layer's parsers and environment reader, on text captured from Slurm 22.05."""

from __future__ import annotations

import pytest

from hpc_elastic.errors import SlurmError
from hpc_elastic.slurm import commands
from hpc_elastic.slurm.commands import JobStatus, SlurmJobId
from hpc_elastic.slurm.env import SlurmContext

SQUEUE_OUT = """\
5|3|PENDING|BeginTime|
4|N/A|RUNNING|None|n[1-2]
5|0-2|PENDING|Resources|
"""

SCONTROL_OUT = (
    "JobId=1 JobName=h1 job.sh UserId=root(0) JobState=PENDING Reason=BeginTime "
    "Requeue=1 Restarts=1 TRES=cpu=4,node=2,billing=4 AllocNode:Sid=localhost:3415 "
    "ExcNodeList=(null) NodeList=n[1-2] Socks/Node=* Command=/tmp/h1-job.sh Power= \n"
)

SBATCH_BAD_PARTITION = (
    "sbatch: error: invalid partition specified: xyz\n"
    "sbatch: error: Batch job submission failed: Invalid partition name specified\n"
)

STEP_ENV = {
    "SLURMD_NODENAME": "n3",
    "SLURM_ARRAY_JOB_ID": "5",
    "SLURM_ARRAY_TASK_ID": "1",
    "SLURM_JOB_ID": "7",
    "SLURM_JOB_NODELIST": "n[1-3],gpu7",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_RESTART_COUNT": "2",
    "SLURM_STEP_ID": "0",
}


def test_sbatch_parsable_output_with_and_without_cluster() -> None:
    assert commands.parse_sbatch_parsable("42\n") == SlurmJobId("42")
    assert commands.parse_sbatch_parsable("42;local\n") == SlurmJobId("42")


def test_sbatch_garbage_output_is_one_sentence() -> None:
    with pytest.raises(SlurmError, match="sbatch answered 'Submitted batch job x'"):
        commands.parse_sbatch_parsable("Submitted batch job x")


def test_bad_partition_names_the_partition_and_suggests_sinfo() -> None:
    message = commands.explain_sbatch_error(SBATCH_BAD_PARTITION)
    assert message == (
        "Slurm has no partition 'xyz'; run `sinfo` to list the partitions and pick one of them."
    )


def test_unknown_sbatch_error_keeps_slurms_reason() -> None:
    message = commands.explain_sbatch_error(
        "sbatch: error: Batch job submission failed: Requested time limit is invalid\n"
    )
    assert "Requested time limit is invalid" in message
    assert "\n" not in message


def test_partitions_are_unique_in_sinfo_order() -> None:
    assert commands.parse_partitions("low\nhigh\nlow\n\n") == ["low", "high"]


def test_squeue_lines_become_statuses() -> None:
    assert commands.parse_squeue(SQUEUE_OUT) == [
        JobStatus(SlurmJobId("5"), "3", "PENDING", "BeginTime", ""),
        JobStatus(SlurmJobId("4"), None, "RUNNING", "None", "n[1-2]"),
        JobStatus(SlurmJobId("5"), "0-2", "PENDING", "Resources", ""),
    ]


def test_squeue_in_another_format_is_refused() -> None:
    with pytest.raises(SlurmError, match="squeue printed 'JOBID PARTITION'"):
        commands.parse_squeue("JOBID PARTITION\n")


def test_scontrol_record_keeps_values_with_spaces_and_equals() -> None:
    record = commands.parse_scontrol_record(SCONTROL_OUT)
    assert record["JobName"] == "h1 job.sh"
    assert record["TRES"] == "cpu=4,node=2,billing=4"
    assert record["AllocNode:Sid"] == "localhost:3415"
    assert record["Socks/Node"] == "*"
    assert record["Restarts"] == "1"
    assert record["Power"] == ""


def test_empty_scontrol_output_is_refused() -> None:
    with pytest.raises(SlurmError, match="no Key=Value fields"):
        commands.parse_scontrol_record("")


def test_missing_sbatch_says_where_to_run() -> None:
    with pytest.raises(SlurmError) as caught:
        commands.sbatch("#!/bin/bash\n", env={"PATH": "/nonexistent"})
    assert str(caught.value) == (
        "sbatch was not found on PATH; run this on a Slurm login node or install Slurm."
    )
    assert isinstance(caught.value.__cause__, FileNotFoundError)


def test_update_job_needs_a_field() -> None:
    with pytest.raises(SlurmError, match="got no fields"):
        commands.update_job("7")


def test_context_from_a_step_environment() -> None:
    context = SlurmContext.from_env(STEP_ENV)
    assert context == SlurmContext(
        job_id="7",
        node_name="n3",
        node_id=2,
        num_nodes=4,
        nodelist="n[1-3],gpu7",
        restart_count=2,
        array_job_id="5",
        array_task_id=1,
        step_id="0",
    )
    assert context.slot == "1"


def test_batch_script_environment_has_no_step_and_no_restart_yet() -> None:
    batch = {"SLURM_JOB_ID": "9", "SLURMD_NODENAME": "n1", "SLURM_NNODES": "2"}
    context = SlurmContext.from_env(batch)
    assert context is not None
    assert (context.step_id, context.restart_count, context.num_nodes) == (None, 0, 2)
    assert context.slot == "n1"


def test_outside_slurm_there_is_no_context() -> None:
    assert SlurmContext.from_env({"PATH": "/usr/bin"}) is None


def test_malformed_number_is_one_sentence() -> None:
    with pytest.raises(SlurmError, match="SLURM_NODEID='x' is not a number"):
        SlurmContext.from_env({"SLURM_JOB_ID": "1", "SLURM_NODEID": "x"})
