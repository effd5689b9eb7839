"""The renderer: pinned by reference scripts, and safe against hostile values.

Reference scripts live in tests/reference/. After an intended change, regenerate them with
``HPC_ELASTIC_UPDATE_REFERENCE=1 pytest tests/cli/test_render.py`` and review the diff.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from cluster import REPO, Cluster, wait_until

from hpc_elastic import events
from hpc_elastic.errors import TemplateError, UsageError
from hpc_elastic.render import (
    RenderContext,
    container_mounts,
    outermost,
    render,
    template_variables,
)
from hpc_elastic.spec import JobSpec, NodeRange, PreemptSignal

REFERENCE_DIR = Path(__file__).parents[1] / "reference"
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


PYXIS = replace(
    ELASTIC,
    container_image="nvcr.io#nvidia/pytorch:24.05-py3",
    container_mounts=("/datasets:/data:ro",),
)
APPTAINER = replace(
    ELASTIC,
    apptainer="/images/pytorch-24.sif",
    container_mounts=("/datasets",),
    container_python="/opt/conda/bin/python",
)


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("elastic_defaults", ELASTIC),
        ("fixed_all_options", FULL_FIXED),
        ("elastic_pyxis", PYXIS),
        ("fixed_pyxis", replace(PYXIS, nodes=NodeRange(2, 2))),
        ("elastic_apptainer", APPTAINER),
    ],
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


def test_with_pyxis_the_whole_step_runs_in_the_image_with_the_job_directories_mounted(
    tmp_path: Path,
) -> None:
    argv, _ = _run_with_fake_srun(render(PYXIS, CONTEXT).text, tmp_path)
    assert argv[:4] == [
        "--ntasks=1",
        "--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
        f"--container-mounts=/scratch/runs/{RUN_ID}:/scratch/runs/{RUN_ID},"
        "/home/ada:/home/ada,/datasets:/data:ro",
        "python3",
    ]
    assert argv[argv.index("--") + 1 :] == ["python3", "-u", "/home/ada/train.py"]


def test_with_apptainer_the_agent_stays_outside_and_each_worker_runs_in_the_image(
    tmp_path: Path,
) -> None:
    argv, _ = _run_with_fake_srun(render(APPTAINER, CONTEXT).text, tmp_path)
    assert argv[1] == CONTEXT.python
    assert not any(word.startswith("--container") for word in argv)
    assert "--prewarm" not in argv  # a standby would be a host Python, outside the image
    assert argv[argv.index("--") + 1 :] == [
        "apptainer", "exec", "--nv",
        "--bind", f"/scratch/runs/{RUN_ID}:/scratch/runs/{RUN_ID},/home/ada:/home/ada,"
        "/datasets:/datasets",
        "/images/pytorch-24.sif", "/opt/conda/bin/python", "-u", "/home/ada/train.py",
    ]  # fmt: skip


def test_hostile_image_names_reach_srun_and_apptainer_as_plain_data(tmp_path: Path) -> None:
    image = "x';touch${IFS}pwned;'$(touch${IFS}pwned)`touch${IFS}pwned`"
    argv, _ = _run_with_fake_srun(render(replace(PYXIS, container_image=image), CONTEXT).text,
                                  tmp_path)  # fmt: skip
    assert argv[1] == f"--container-image={image}"
    (tmp_path / "bin").rename(tmp_path / "bin-pyxis")
    argv, _ = _run_with_fake_srun(render(replace(APPTAINER, apptainer=image), CONTEXT).text,
                                  tmp_path)  # fmt: skip
    assert argv[argv.index("exec") + 4] == image
    assert not (tmp_path / "pwned").exists()


def test_a_directory_inside_another_is_mounted_once_as_the_outer_one() -> None:
    spec = replace(PYXIS, script=Path(f"/scratch/runs/{RUN_ID}/code/train.py"))
    assert container_mounts(spec, CONTEXT.job_dir) == (
        f"/scratch/runs/{RUN_ID}:/scratch/runs/{RUN_ID}",
        "/datasets:/data:ro",
    )
    assert outermost([Path("/a/b"), Path("/c"), Path("/a"), Path("/c")]) == [Path("/c"), Path("/a")]


def test_without_a_container_the_worker_runs_under_the_agents_python() -> None:
    variables = template_variables(ELASTIC, CONTEXT)
    assert variables["container_image"] == variables["container_mounts"] == ""
    assert variables["worker"] == "/opt/venv/bin/python -u /home/ada/train.py"


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


def test_the_preflight_and_straggler_options_given_at_submit_reach_the_agent_line(
    tmp_path: Path,
) -> None:
    spec = replace(ELASTIC, setup=(), expected_gpus=8, bad_node_ttl=3600.0, exclude_stragglers=True)
    argv, _ = _run_with_fake_srun(render(spec, CONTEXT).text, tmp_path)
    agent = argv[argv.index("agent") + 1 : argv.index("--")]
    assert agent[agent.index("--expected-gpus") + 1] == "8"
    assert agent[agent.index("--bad-node-ttl") + 1] == "3600"
    assert "--exclude-stragglers" in agent
    unset = tmp_path / "unset"
    unset.mkdir()
    plain, _ = _run_with_fake_srun(render(replace(ELASTIC, setup=()), CONTEXT).text, unset)
    assert not {"--expected-gpus", "--bad-node-ttl", "--exclude-stragglers"} & set(plain)


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
    guide = (Path(__file__).parents[2] / "docs" / "submit.md").read_text()
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


@pytest.mark.parametrize(
    "escape",
    [
        "{{ cycler.__init__.__globals__.os.system('touch CANARY') }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.system('x') }}",
        "{{ lipsum.__globals__['os'].system('touch CANARY') }}",
    ],
)
def test_a_template_cannot_reach_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, escape: str
) -> None:
    """A template named by a planted config file must not run code on the login node."""
    monkeypatch.chdir(tmp_path)
    template = tmp_path / "planted.sh.j2"
    template.write_text(escape + "\n")
    with pytest.raises(TemplateError, match=f"^--template '{template}' "):
        render(replace(ELASTIC, template=template), CONTEXT)
    assert not (tmp_path / "CANARY").exists()


def test_sbatch_values_and_the_log_dir_are_escaped_for_sbatchs_own_reader() -> None:
    """sbatch reads ``#SBATCH`` words with backslash escapes and quotes and ends them at a
    ``#``; ``--output`` also expands ``%``: each is escaped so the value arrives verbatim."""
    spec = replace(ELASTIC, sbatch_args=("--comment=a#b'c\"d\\e",))
    context = replace(CONTEXT, job_dir=Path("/runs/100%#1'x") / RUN_ID)
    lines = render(spec, context).text.splitlines()
    assert "#SBATCH --comment=a\\#b\\'c\\\"d\\\\e" in lines
    assert f"#SBATCH --output=/runs/100%%\\#1\\'x/{RUN_ID}/slurm-%A_%a.out" in lines


def test_a_log_dir_with_a_backslash_is_refused() -> None:
    with pytest.raises(UsageError, match="contains a backslash"):
        replace(ELASTIC, log_dir=Path("runs\\x"))


@pytest.mark.integration
def test_real_sbatch_reads_escaped_values_and_log_dir_back_verbatim(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The escaping above, checked against Slurm itself: the held job's Comment, then the
    output file slurmd writes once it is released (scontrol shows ``%%x`` expanded, slurmd
    does not, so the file is what counts)."""
    (tmp_path / "train.py").write_text("pass\n")
    (tmp_path / "echo.sh.j2").write_text(
        '{% extends "fixed.sh.j2" %}{% block launch %}echo ran{% endblock %}\n'
    )
    comment = "a#b'c\"d\\e"
    log_dir = tmp_path / "runs%x#y'z"
    argv = [
        *(sys.executable, "-m", "hpc_elastic", "submit", "--nodes=1", "--template=echo.sh.j2"),
        *(f"--log-dir={log_dir}", f"--sbatch-arg=--comment={comment}", "--sbatch-arg=--hold"),
        "train.py",
    ]
    result = subprocess.run(
        argv,
        cwd=tmp_path,
        env={**cluster.env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.split()[3]
    [job_dir] = log_dir.iterdir()
    try:
        shown = cluster.run(["scontrol", "show", "job", job_id]).stdout
        fields = dict(item.split("=", 1) for item in shown.split() if "=" in item)
        assert fields["Comment"] == comment
        cluster.run(["scontrol", "release", job_id])
        output = job_dir / f"slurm-{job_id}.out"
        assert wait_until(output.exists, 60), sorted(job_dir.iterdir())
        assert wait_until(lambda: output.read_text() == "ran\n", 60), output.read_text()
    finally:
        cluster.run(["scancel", job_id], check=False)


def test_render_from_the_command_line_takes_one_container_runtime_and_refuses_two(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner  # noqa: PLC0415

    from hpc_elastic import cli  # noqa: PLC0415

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    runner = CliRunner()
    both = runner.invoke(
        cli.app, ["render", "--container-image", "pt", "--apptainer", "/pt.sif", "train.py"]
    )
    assert both.exit_code == 2
    assert both.stderr == (
        "error: --container-image 'pt' and --apptainer '/pt.sif' are two container runtimes "
        "for one job; give only one.\n"
    )
    one = runner.invoke(
        cli.app,
        ["render", "--apptainer", "/pt.sif", "--container-mounts", "/data", "--nodes", "1:2",
         "--no-snapshot", "train.py"],
    )  # fmt: skip
    assert one.exit_code == 0, one.stderr
    # The job directory lies inside the script's (./hpc-elastic-runs): one mount covers both.
    worker = f"--bind {tmp_path}:{tmp_path},/data:/data /pt.sif python3 -u {tmp_path}/train.py"
    assert f"-- apptainer exec --nv {worker}\n" in one.stdout
    # With the default code snapshot the worker runs the copy, inside the job directory: the
    # job directory is the one mount that covers both.
    copied = runner.invoke(cli.app, ["render", "--apptainer", "/pt.sif", "train.py"])
    assert copied.exit_code == 0, copied.stderr
    job_dir = re.search(r"--job-dir (\S+)", copied.stdout)
    assert job_dir is not None
    worker = f"--bind {job_dir[1]}:{job_dir[1]} /pt.sif python3 -u {job_dir[1]}/code/train.py"
    assert f"-- apptainer exec --nv {worker} &\n" in copied.stdout


APPTAINER_SHIM = """#!/bin/bash
# A stand-in for Apptainer (none exists on the test machine): it records its argv, checks that
# every bound source exists, and runs the command after the image, as `apptainer exec` would.
printf '%s\\0' "$@" > "$(dirname "$0")/argv.$$"
[ "$1" = exec ] && [ "$2" = --nv ] && [ "$3" = --bind ] || exit 97
IFS=, read -ra binds <<< "$4"
for bind in "${binds[@]}"; do [ -d "${bind%%:*}" ] || exit 98; done
shift 5
exec "$@"
"""


@pytest.mark.integration
def test_an_apptainer_job_on_the_real_cluster_runs_its_worker_through_apptainer_exec(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The rendered worker command reaches `apptainer` word for word on a compute node, with
    the job and script directories bound, and the job finishes through it."""
    shim_dir = tmp_path / "bin"
    shim_dir.mkdir()
    (shim_dir / "apptainer").write_text(APPTAINER_SHIM)
    (shim_dir / "apptainer").chmod(0o755)
    project = tmp_path / "project"
    project.mkdir()
    script = project / "train.py"
    script.write_text("import sys\nprint('trained in', sys.argv[1:])\n")
    env = {**cluster.env, "PYTHONPATH": str(REPO), "PATH": f"{shim_dir}:{cluster.env['PATH']}"}
    result = subprocess.run(
        [
            sys.executable, "-m", "hpc_elastic", "submit", "--nodes=1", "--partition=low",
            f"--zk={cluster.zk_hosts}", f"--log-dir={tmp_path / 'runs'}",
            "--apptainer=/images/pytorch.sif", "--container-python=python3", str(script),
            "--", "--lr", "3e-4",
        ],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    job_dir = next((tmp_path / "runs").iterdir())
    history = job_dir / "events.jsonl"

    def finished() -> bool:
        return history.exists() and any(event.kind == "done" for event in events.read(history))

    assert wait_until(finished, 180, interval=1.0), list(job_dir.rglob("*"))
    [recorded] = list(shim_dir.glob("argv.*"))
    # The worker runs the job's code snapshot (inside the job directory): one bind covers both.
    assert recorded.read_text().split("\0")[:-1] == [
        "exec", "--nv", "--bind", f"{job_dir}:{job_dir}",
        "/images/pytorch.sif", "python3", "-u", str(job_dir / "code" / "train.py"), "--lr", "3e-4",
    ]  # fmt: skip
    logs = "".join(path.read_text() for path in (job_dir / "logs").rglob("*.log"))
    assert "trained in ['--lr', '3e-4']" in logs


PYXIS_SHIM = """#!/bin/bash
# A stand-in for srun with the pyxis plugin (none exists on the test machine): it records its
# argv, checks that every mounted source exists, drops the pyxis options and runs the real srun.
printf '%s\\0' "$@" > "$(dirname "$0")/argv.$$"
args=()
for arg in "$@"; do
  case "$arg" in
    --container-image=*) ;;
    --container-mounts=*)
      IFS=, read -ra mounts <<< "${arg#--container-mounts=}"
      for mount in "${mounts[@]}"; do [ -d "${mount%%:*}" ] || exit 98; done ;;
    *) args+=("$arg") ;;
  esac
done
exec REAL_SRUN "${args[@]}"
"""


@pytest.mark.integration
def test_a_pyxis_job_on_the_real_cluster_runs_its_agent_step_with_the_container_options(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The agent's srun step carries --container-image and --container-mounts as rendered, runs
    the agent under --container-python, and the job finishes."""
    real_srun = subprocess.run(
        ["bash", "-c", "command -v srun"], env=cluster.env, capture_output=True, text=True,
        check=True,
    ).stdout.strip()  # fmt: skip
    shim_dir = tmp_path / "bin"
    shim_dir.mkdir()
    (shim_dir / "srun").write_text(PYXIS_SHIM.replace("REAL_SRUN", real_srun))
    (shim_dir / "srun").chmod(0o755)
    project = tmp_path / "project"
    project.mkdir()
    script = project / "train.py"
    script.write_text("print('trained')\n")
    env = {**cluster.env, "PYTHONPATH": str(REPO), "PATH": f"{shim_dir}:{cluster.env['PATH']}"}
    result = subprocess.run(
        [
            sys.executable, "-m", "hpc_elastic", "submit", "--nodes=1:2", "--partition=low",
            f"--zk={cluster.zk_hosts}", f"--log-dir={tmp_path / 'runs'}", "--no-prewarm",
            "--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
            f"--container-mounts={tmp_path}", f"--container-python={sys.executable}",
            str(script),
        ],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    job_dir = next((tmp_path / "runs").iterdir())
    history = job_dir / "events.jsonl"

    def finished() -> bool:
        return history.exists() and any(event.kind == "done" for event in events.read(history))

    assert wait_until(finished, 180, interval=1.0), list(job_dir.rglob("*"))
    assert wait_until(lambda: not cluster.squeue(), 120), cluster.squeue()
    steps = [path.read_text().split("\0")[:-1] for path in shim_dir.glob("argv.*")]
    agent_steps = [argv for argv in steps if "hpc_elastic" in argv]
    assert agent_steps, steps
    for argv in agent_steps:
        # The job directory holds the code snapshot the workers run: it is the one default mount.
        assert argv[1:4] == [
            "--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
            f"--container-mounts={job_dir}:{job_dir},{tmp_path}:{tmp_path}",
            sys.executable,
        ]
        copied = job_dir / "code" / "train.py"
        assert argv[argv.index("--") + 1 :] == [sys.executable, "-u", str(copied)]
