"""The renderer: pinned by reference scripts, and safe against hostile values.

Reference scripts live in tests/reference/. After an intended change, regenerate them with
``HPC_ELASTIC_UPDATE_REFERENCE=1 pytest tests/test_render.py`` and review the diff.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from hpc_elastic.errors import TemplateError, UsageError
from hpc_elastic.render import RenderContext, render, template_variables
from hpc_elastic.spec import JobSpec, NodeRange, PreemptSignal

REFERENCE_DIR = Path(__file__).parent / "reference"
UPDATE_ENV = "HPC_ELASTIC_UPDATE_REFERENCE"
RUN_ID = "train-20261129-101500-beef"
CONTEXT = RenderContext(
    version="0.1.0",
    command_line=("hpc-elastic", "submit", "--nodes", "1:4", "train.py"),
    python="/opt/venv/bin/python",
    run_id=RUN_ID,
    job_dir=Path("/scratch/runs") / RUN_ID,
)
ELASTIC = JobSpec(script=Path("/home/ada/train.py"), nodes=NodeRange(1, 4), job_name="train")
FULL_FIXED = JobSpec(
    script=Path("/home/ada/train.py"),
    script_args=("--epochs", "10", "--note", "it's fine"),
    nodes=NodeRange(4, 4),
    nproc_per_node=8,
    job_name="train",
    partition="gpu",
    account="proj42",
    qos="high",
    time="1-00:00:00",
    gpus_per_node=8,
    cpus_per_task=64,
    mem="480G",
    constraint="a100&ib",
    exclude="n[1-3]",
    requeue=False,
    signal=PreemptSignal("USR1", 120),
    setup=("module load cuda/12.4", "source /opt/venv/bin/activate"),
    env=(("OMP_NUM_THREADS", "8"), ("NCCL_DEBUG", "WARN")),
    max_restarts=5,
    zk="zk1:2181,zk2:2181/hpc",
    sbatch_args=("--reservation=big", "--mail-type=END"),
    hang_timeout=300,
    last_call=5,
    session_timeout=10,
    min_wait=600,
)


@pytest.mark.parametrize(
    ("name", "spec"),
    [("elastic_defaults", ELASTIC), ("fixed_all_options", FULL_FIXED)],
)
def test_script_matches_reference(name: str, spec: JobSpec) -> None:
    reference = REFERENCE_DIR / f"{name}.sh"
    text = render(spec, CONTEXT).text
    if os.environ.get(UPDATE_ENV):
        reference.parent.mkdir(exist_ok=True)
        reference.write_text(text)
    assert text == reference.read_text(), f"re-run with {UPDATE_ENV}=1 if the change is intended"


def test_render_is_pure() -> None:
    assert render(FULL_FIXED, CONTEXT) == render(FULL_FIXED, CONTEXT)


def test_shape_follows_the_node_range() -> None:
    elastic = render(ELASTIC, CONTEXT)
    fixed = render(replace(ELASTIC, nodes=NodeRange(3, 3)), CONTEXT)
    assert elastic.template == "elastic.sh.j2"
    assert "#SBATCH --array=0-3\n#SBATCH --nodes=1\n" in elastic.text
    assert f"--output=/scratch/runs/{RUN_ID}/slurm-%A_%a.out" in elastic.text
    assert fixed.template == "fixed.sh.j2"
    assert "#SBATCH --nodes=3\n#SBATCH --ntasks-per-node=1\n#SBATCH --no-kill\n" in fixed.text
    assert f"--output=/scratch/runs/{RUN_ID}/slurm-%j.out" in fixed.text


HOSTILE = "$(touch pwned) `touch pwned` ; touch pwned ' \" \\ {{ 7 * 7 }} {% raw %}\n#SBATCH --x"


def _run_with_fake_srun(script: str, tmp_path: Path) -> tuple[list[str], str]:
    """Run the script under bash with an srun that records its argv, NUL-separated, on a
    one-node allocation."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text('#!/bin/bash\nprintf "%s\\0" "$@" > argv\nprintf "%s" "$HOSTILE" > env\n')
    srun.chmod(0o755)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/bash\necho n1\n")
    scontrol.chmod(0o755)
    (tmp_path / "job.sh").write_text(script)
    subprocess.run(
        ["bash", "job.sh"],
        cwd=tmp_path,
        env={
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "SLURM_ARRAY_TASK_ID": "0",
            "SLURM_JOB_NODELIST": "n1",
        },
        check=True,
        timeout=30,
    )
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    return argv, (tmp_path / "env").read_text()


def test_hostile_values_reach_the_job_as_plain_data(tmp_path: Path) -> None:
    spec = replace(ELASTIC, script_args=(HOSTILE, "--x"), env=(("HOSTILE", HOSTILE),))
    context = replace(CONTEXT, command_line=("hpc-elastic", "submit", HOSTILE))
    argv, env_value = _run_with_fake_srun(render(spec, context).text, tmp_path)
    assert argv[-4:] == ["-u", "/home/ada/train.py", HOSTILE, "--x"]
    assert env_value == HOSTILE
    assert not (tmp_path / "pwned").exists()


def test_header_command_line_cannot_end_its_comment() -> None:
    context = replace(CONTEXT, command_line=("hpc-elastic", "x\nrm -rf ~\n#SBATCH --uid=0"))
    text = render(ELASTIC, context).text
    assert "rm -rf ~" in text.splitlines()[2]
    assert text.count("\n#SBATCH --uid") == 0


def test_agent_flags_are_quoted(tmp_path: Path) -> None:
    spec = replace(FULL_FIXED, setup=())
    argv, _ = _run_with_fake_srun(render(spec, CONTEXT).text, tmp_path)
    agent = argv[argv.index("agent") + 1 : argv.index("--")]
    assert agent[agent.index("--zk") + 1] == "zk1:2181,zk2:2181/hpc"
    assert agent[agent.index("--zk-auth-file") + 1] == f"/scratch/runs/{RUN_ID}/secret"
    assert agent[agent.index("--grace") + 1] == "120"
    assert argv[-2:] == ["--note", "it's fine"]


def test_job_dir_with_spaces_is_refused() -> None:
    with pytest.raises(UsageError, match="contains spaces"):
        replace(CONTEXT, job_dir=Path("/my runs/x"))


def test_user_template_can_extend_a_builtin(tmp_path: Path) -> None:
    template = tmp_path / "mine.sh.j2"
    template.write_text(
        '{% extends "elastic.sh.j2" %}\n'
        "{% block launch %}\necho {{ run_id }} {{ nodes_max }} {{ worker }}\n{% endblock %}\n"
    )
    script = render(replace(ELASTIC, template=template), CONTEXT)
    assert script.template == str(template)
    assert "#SBATCH --array=0-3" in script.text
    assert script.text.endswith(f"echo {RUN_ID} 4 /opt/venv/bin/python -u /home/ada/train.py\n")


def test_template_variables_are_documented() -> None:
    guide = (Path(__file__).parent.parent / "docs" / "submit.md").read_text()
    for name in template_variables(ELASTIC, CONTEXT):
        assert f"`{name}`" in guide


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (None, "cannot be read"),
        ("{% if %}", "has a syntax error at line 1"),
        ("{{ no_such_variable }}", "failed to render: 'no_such_variable' is undefined"),
        ('{% extends "missing.sh.j2" %}', "failed to render: 'missing.sh.j2' not found"),
    ],
)
def test_broken_user_templates_are_one_sentence(
    tmp_path: Path, source: str | None, message: str
) -> None:
    template = tmp_path / "mine.sh.j2"
    if source is not None:
        template.write_text(source)
    with pytest.raises(TemplateError, match=f"--template '{template}' {message}"):
        render(replace(ELASTIC, template=template), CONTEXT)
