"""Code snapshots: what the copy holds, where the rendered script points, and the size cap.

The copy rules run on real temporary git work trees and directories (git itself, no fake);
submit runs on a fake Slurm (``slurm_fake``: only the subprocess call is swapped).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from slurm_fake import mocked_slurm, mocked_submit

from hpc_elastic import snapshot
from hpc_elastic.errors import SnapshotError, UsageError
from hpc_elastic.jobdir import CodeSnapshot, JobRecord
from hpc_elastic.slurm import commands
from hpc_elastic.spec import JobSpec, NodeRange
from hpc_elastic.submission import plan, submit


def git(repo: Path, *args: str) -> str:
    environment = {
        **os.environ,
        "GIT_AUTHOR_NAME": "Ada",
        "GIT_AUTHOR_EMAIL": "ada@example.com",
        "GIT_COMMITTER_NAME": "Ada",
        "GIT_COMMITTER_EMAIL": "ada@example.com",
        "GIT_CONFIG_GLOBAL": os.devnull,
    }
    done = subprocess.run(
        ["git", "-C", str(repo), *args], env=environment, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A committed git project: a script, a module beside it, an ignored data file."""
    repo = tmp_path / "project"
    (repo / "models").mkdir(parents=True)
    (repo / "train.py").write_text("import models.net\nprint(models.net.VERSION)\n")
    (repo / "models" / "net.py").write_text("VERSION = 1\n")
    (repo / ".gitignore").write_text("data/\n*.ckpt\n")
    git(repo, "init", "--quiet")
    git(repo, "add", ".")
    git(repo, "commit", "--quiet", "-m", "first")
    (repo / "data").mkdir()
    (repo / "data" / "shard0.bin").write_bytes(b"\0" * 1000)
    (repo / "old.ckpt").write_bytes(b"\0" * 1000)
    return repo


def copied(root: Path) -> set[str]:
    return {
        path.relative_to(root).as_posix()
        for path in root.rglob("*")
        if path.is_file() or path.is_symlink()
    }


def test_a_clean_work_tree_copies_its_tracked_files_and_records_the_commit(
    project: Path, tmp_path: Path
) -> None:
    code = snapshot.survey(project / "train.py", project / "runs", max_mb=100)
    snapshot.take(code, tmp_path / "copy")
    assert copied(tmp_path / "copy") == {".gitignore", "train.py", "models/net.py"}
    assert code.git
    assert code.commit == git(project, "rev-parse", "HEAD")
    assert code.dirty is False


def test_ignored_files_stay_out_and_untracked_ones_come_in_and_make_the_tree_dirty(
    project: Path, tmp_path: Path
) -> None:
    (project / "models" / "new_layer.py").write_text("X = 2\n")  # written today, not added
    code = snapshot.survey(project / "train.py", project / "runs", max_mb=100)
    snapshot.take(code, tmp_path / "copy")
    assert "models/new_layer.py" in copied(tmp_path / "copy")
    assert not {"data/shard0.bin", "old.ckpt"} & copied(tmp_path / "copy")
    assert code.dirty is True


def test_an_edited_tracked_file_is_copied_as_it_is_on_disk_and_the_tree_is_dirty(
    project: Path, tmp_path: Path
) -> None:
    (project / "models" / "net.py").write_text("VERSION = 2\n")
    code = snapshot.survey(project / "train.py", project / "runs", max_mb=100)
    snapshot.take(code, tmp_path / "copy")
    assert (tmp_path / "copy" / "models" / "net.py").read_text() == "VERSION = 2\n"
    assert code.dirty is True


def test_the_log_directory_inside_the_project_is_never_copied(
    project: Path, tmp_path: Path
) -> None:
    earlier = project / "hpc-elastic-runs" / "train-1"
    earlier.mkdir(parents=True)
    (earlier / "secret").write_text("s3cret")  # not ignored: only the log-dir rule keeps it out
    code = snapshot.survey(project / "train.py", project / "hpc-elastic-runs", max_mb=100)
    assert not any(entry.path.startswith("hpc-elastic-runs") for entry in code.entries)


def test_an_ignored_script_is_still_copied(project: Path) -> None:
    (project / "data" / "probe.py").write_text("print('probe')\n")
    code = snapshot.survey(project / "data" / "probe.py", project / "runs", max_mb=100)
    assert "data/probe.py" in {entry.path for entry in code.entries}


def test_over_the_cap_the_error_is_one_sentence_naming_the_biggest_files_and_the_ways_out(
    project: Path,
) -> None:
    (project / "weights.bin").write_bytes(b"\0" * 1_500_000)  # not ignored, 1.5 MB
    (project / "vocab.txt").write_bytes(b"a" * 300_000)
    with pytest.raises(SnapshotError) as caught:
        snapshot.survey(project / "train.py", project / "runs", max_mb=1)
    message = str(caught.value)
    assert message.startswith(f"The code snapshot of '{project.resolve()}' would hold 1.8 MB")
    assert "over the 1 MB cap" in message
    assert "weights.bin (1.5 MB), vocab.txt (0.3 MB)" in message
    assert "raise --snapshot-max-mb, or submit with --no-snapshot." in message
    assert message.count(". ") == 0
    assert message.endswith(".")
    assert isinstance(caught.value, UsageError)  # the CLI prints it as one line, exit code 2


def test_outside_git_the_scripts_directory_is_copied_without_caches(tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    (folder / "__pycache__").mkdir(parents=True)
    (folder / "__pycache__" / "train.cpython-312.pyc").write_bytes(b"\0")
    (folder / "lib").mkdir()
    (folder / "lib" / "util.py").write_text("")
    (folder / "train.py").write_text("")
    code = snapshot.survey(folder / "train.py", folder / "hpc-elastic-runs", max_mb=100)
    snapshot.take(code, tmp_path / "copy")
    assert copied(tmp_path / "copy") == {"train.py", "lib/util.py"}
    assert (code.git, code.commit, code.dirty) == (False, None, None)


def test_a_huge_plain_directory_stops_the_walk_and_says_more_than(tmp_path: Path) -> None:
    folder = tmp_path / "home"
    folder.mkdir()
    (folder / "train.py").write_text("")
    for index in range(3):
        (folder / f"blob{index}").write_bytes(b"\0" * 600_000)
    with pytest.raises(SnapshotError, match=r"would hold more than 1\.\d MB, over the 1 MB cap"):
        snapshot.survey(folder / "train.py", folder / "runs", max_mb=1)


def test_links_are_copied_as_links_inside_stays_inside_and_outside_is_never_read(
    project: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "datasets"
    (outside / "imagenet").mkdir(parents=True)
    (outside / "imagenet" / "huge.bin").write_bytes(b"\0" * 10)
    os.symlink("../train.py", project / "models" / "entry.py")  # relative, inside
    os.symlink(project / "models" / "net.py", project / "net_link.py")  # absolute, inside
    os.symlink(outside / "imagenet", project / "imagenet")  # a directory outside
    os.symlink("../datasets", project / "escape")  # relative, leads out
    git(project, "add", ".")
    code = snapshot.survey(project / "train.py", project / "runs", max_mb=100)
    copy = tmp_path / "copy"
    snapshot.take(code, copy)
    assert os.readlink(copy / "models" / "entry.py") == "../train.py"
    assert os.readlink(copy / "net_link.py") == "models/net.py"  # now into the copy
    assert (copy / "net_link.py").resolve() == (copy / "models" / "net.py").resolve()
    assert os.readlink(copy / "imagenet") == str(outside.resolve() / "imagenet")
    assert os.readlink(copy / "escape") == str(outside.resolve())
    assert not any(path.name == "huge.bin" for path in copy.rglob("*") if not path.is_symlink())
    assert {entry.size for entry in code.entries if entry.link is not None} == {0}


def test_file_and_directory_modes_are_kept(project: Path, tmp_path: Path) -> None:
    (project / "run.sh").write_text("#!/bin/sh\n")
    (project / "run.sh").chmod(0o750)
    (project / "models").chmod(0o500)  # read-only: filled first, its mode applied after
    try:
        code = snapshot.survey(project / "train.py", project / "runs", max_mb=100)
        snapshot.take(code, tmp_path / "copy")
        assert (tmp_path / "copy" / "run.sh").stat().st_mode & 0o777 == 0o750
        assert (tmp_path / "copy" / "models").stat().st_mode & 0o777 == 0o500
        assert (tmp_path / "copy" / "models" / "net.py").read_text() == "VERSION = 1\n"
    finally:
        (project / "models").chmod(0o700)
        if (tmp_path / "copy" / "models").exists():
            (tmp_path / "copy" / "models").chmod(0o700)  # so pytest can clean up


# --- the plan and the job directory ------------------------------------------------------------


NOW = datetime(2026, 12, 1, 3, 0, 0)


def planned(project: Path, cwd: Path, **spec: object) -> object:
    job = JobSpec(
        script=project / "train.py",
        log_dir=project / "runs",
        job_name="train",
        nodes=NodeRange(1, 2),
        **spec,  # type: ignore[arg-type]
    )
    return plan(
        job, ("hpc-elastic", "submit", "train.py"), "/venv/bin/python", NOW, "beef", cwd=cwd
    )


def test_the_rendered_worker_and_working_directory_point_into_the_snapshot(
    project: Path,
) -> None:
    job = planned(project, cwd=project / "models")
    copy = project.resolve() / "runs" / "train-20261201-030000-beef" / "code"
    text = job.script.text  # type: ignore[attr-defined]
    assert f"  -- /venv/bin/python -u {copy}/train.py\n" in text
    assert f"#SBATCH --chdir={copy}/models\n" in text


def test_from_outside_the_project_the_working_directory_is_left_where_submit_ran(
    project: Path, tmp_path: Path
) -> None:
    text = planned(project, cwd=tmp_path).script.text  # type: ignore[attr-defined]
    assert "/code/train.py\n" in text
    assert "--chdir" not in text


def test_no_snapshot_runs_the_script_where_it_is(project: Path) -> None:
    job = planned(project, cwd=project, snapshot=False)
    assert f"-u {project}/train.py\n" in job.script.text  # type: ignore[attr-defined]
    assert "--chdir" not in job.script.text  # type: ignore[attr-defined]
    assert job.code is None  # type: ignore[attr-defined]


def test_a_users_own_chdir_wins(project: Path) -> None:
    text = planned(project, cwd=project, sbatch_args=("--chdir=/scratch",)).script.text  # type: ignore[attr-defined]
    assert text.count("--chdir") == 1
    assert "#SBATCH --chdir=/scratch\n" in text


def test_submit_copies_the_project_and_job_json_records_commit_and_dirty(project: Path) -> None:
    (project / "models" / "net.py").write_text("VERSION = 2\n")
    job = planned(project, cwd=project)
    with mocked_submit():
        submitted = submit(job, commands)  # type: ignore[arg-type]
    copy = submitted.plan.paths.code
    (project / "models" / "net.py").write_text("VERSION = 3\n")  # edited while the job waits
    assert (copy / "models" / "net.py").read_text() == "VERSION = 2\n"
    record = JobRecord.load(submitted.plan.job_dir)
    assert record.snapshot == CodeSnapshot(
        dir=copy,
        source=project.resolve(),
        git=True,
        commit=git(project, "rev-parse", "HEAD"),
        dirty=True,
        files=3,
        bytes=record.snapshot.bytes if record.snapshot else -1,
    )
    assert json.loads(record.paths.record.read_text())["snapshot"]["dirty"] is True


def test_submit_says_which_commit_it_snapshotted_whether_dirty_and_how_big(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner  # noqa: PLC0415

    from hpc_elastic import cli  # noqa: PLC0415

    monkeypatch.chdir(project)
    (project / "weights.py").write_text("W = [0] * 1000\n" * 20_000)  # untracked: dirty, 0.3 MB
    with mocked_submit():
        result = CliRunner().invoke(cli.app, ["submit", "--nodes", "1", "train.py"])
    assert (result.exit_code, result.stderr) == (0, "")
    commit = git(project, "rev-parse", "HEAD")[:12]
    said = [line for line in result.stdout.splitlines() if line.startswith("Code:")]
    assert said == [f"Code: snapshot of commit {commit}, with uncommitted changes, 4 files, 0.3 MB"]


def test_submit_without_a_snapshot_says_the_script_runs_as_it_is_on_disk(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner  # noqa: PLC0415

    from hpc_elastic import cli  # noqa: PLC0415

    monkeypatch.chdir(project)
    with mocked_submit():
        result = CliRunner().invoke(cli.app, ["submit", "--no-snapshot", "train.py"])
    assert result.exit_code == 0
    said = [line for line in result.stdout.splitlines() if line.startswith("Code:")]
    assert said == [
        "Code: not snapshotted (--no-snapshot): each slot runs the script as it is on disk"
    ]


def test_a_snapshot_that_cannot_be_copied_leaves_no_job_directory_and_sbatches_nothing(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = planned(project, cwd=project)

    def unreadable(origin: Path, *_: object, **__: object) -> None:
        # chmod 000 does not stop root, who runs CI: refuse at the copy itself
        if origin.name == "net.py":
            raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(shutil, "copy2", unreadable)
    with (
        mocked_slurm() as slurm,  # told nothing: any Slurm call fails the test
        pytest.raises(SnapshotError, match=r"net\.py' cannot be copied into the job's code"),
    ):
        submit(job, commands)  # type: ignore[arg-type]
    assert slurm.submitted == []
    assert not (project / "runs" / "train-20261201-030000-beef").exists()


def test_a_job_json_with_a_forged_snapshot_commit_is_refused(tmp_path: Path) -> None:
    raw = {
        "run_id": "train-1",
        "job_id": "5",
        "snapshot": {"dir": "/x/code", "source": "/x", "git": True, "commit": "$(rm -rf ~)"},
    }
    with pytest.raises(UsageError, match="its snapshot's commit '\\$\\(rm -rf ~\\)' is not a git"):
        JobRecord.from_json(raw, tmp_path)


def test_the_cli_refuses_a_project_over_the_cap_in_one_line_before_writing_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner  # noqa: PLC0415

    from hpc_elastic import cli  # noqa: PLC0415

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 2_000_000)
    result = CliRunner().invoke(cli.app, ["submit", "--snapshot-max-mb", "1", "train.py"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: The code snapshot of ")
    assert "weights.bin (2.0 MB)" in result.stderr
    assert result.stderr.count("\n") == 1
    assert not (tmp_path / "hpc-elastic-runs").exists()


def test_the_api_takes_snapshot_false_and_the_job_then_runs_the_script_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hpc_elastic  # noqa: PLC0415

    monkeypatch.setenv("HPC_ELASTIC_INDEX", str(tmp_path / "index"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    with mocked_submit() as slurm:
        job = hpc_elastic.submit("train.py", nodes=1, snapshot=False)
    assert job.record.snapshot is None
    assert not (job.job_dir / "code").exists()
    assert f"-u {tmp_path / 'train.py'} &\n" in slurm.submitted[0]


def test_outside_git_the_walk_never_enters_the_log_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "plain"
    (folder / "hpc-elastic-runs" / "old-run" / "checkpoints").mkdir(parents=True)
    (folder / "train.py").write_text("")
    entered: list[str] = []
    real_walk = os.walk

    def watched(top: Path, *, followlinks: bool) -> Iterator[tuple[str, list[str], list[str]]]:
        for directory, dirnames, filenames in real_walk(top, followlinks=followlinks):
            entered.append(directory)
            yield directory, dirnames, filenames

    monkeypatch.setattr(os, "walk", watched)
    code = snapshot.survey(folder / "train.py", folder / "hpc-elastic-runs", max_mb=100)
    assert [entry.path for entry in code.entries] == ["train.py"]
    assert entered == [str(folder)]


# --- secrets, homes and the file count (a script outside git) ---------------------------------


def plant_secrets(folder: Path) -> set[str]:
    """Keys, credentials and an earlier job's directory as a home or a scripts folder holds
    them; returns their paths relative to ``folder``."""
    secrets = {
        ".ssh/id_ed25519": "-----BEGIN OPENSSH PRIVATE KEY-----",
        ".ssh/config": "Host *",
        ".aws/credentials": "[default]\naws_secret_access_key = x",
        ".config/gcloud/application_default_credentials.json": "{}",
        ".gnupg/private-keys-v1.d/key.key": "k",
        ".hpc-elastic/user-secret": "user secret",
        ".local/state/hpc-elastic/jobs": "/old/job\n",
        ".netrc": "machine example.com password x",
        "deploy/server.pem": "-----BEGIN PRIVATE KEY-----",
        "id_rsa": "-----BEGIN RSA PRIVATE KEY-----",
        "old-runs/train-20250101-000000-ab/secret": "their job secret",
        "old-runs/train-20250101-000000-ab/job.json": "{}",
        "old-runs/train-20250101-000000-ab/sbatch.sh": "export TOKEN=x",
        "old-runs/train-20250101-000000-ab/code/train.py": "",
    }
    for name, text in secrets.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return set(secrets)


def test_outside_git_keys_credentials_and_other_jobs_are_never_copied(tmp_path: Path) -> None:
    """The attack: a script in a folder of the home directory, outside any repository, copied
    ~/.ssh, ~/.aws, the user secret and earlier jobs' secrets into every job directory."""
    folder = tmp_path / "scripts"
    (folder / "lib").mkdir(parents=True)
    (folder / "train.py").write_text("import lib.util\n")
    (folder / "lib" / "util.py").write_text("")
    planted = plant_secrets(folder)
    code = snapshot.survey(folder / "train.py", folder / "hpc-elastic-runs", max_mb=100)
    snapshot.take(code, tmp_path / "copy")
    assert copied(tmp_path / "copy") == {"train.py", "lib/util.py"}
    assert not planted & {entry.path for entry in code.entries}
    assert set(code.left_out) == {
        ".ssh/",
        ".aws/",
        ".config/gcloud/",
        ".gnupg/",
        ".hpc-elastic/",
        ".local/state/hpc-elastic/",
        ".netrc",
        "deploy/server.pem",
        "id_rsa",
        "old-runs/train-20250101-000000-ab/",
    }


def test_in_a_work_tree_secrets_that_git_does_not_ignore_stay_out_too(
    project: Path, tmp_path: Path
) -> None:
    planted = plant_secrets(project)
    code = snapshot.survey(project / "train.py", project / "runs", max_mb=100)
    snapshot.take(code, tmp_path / "copy")
    assert copied(tmp_path / "copy") == {".gitignore", "train.py", "models/net.py"}
    assert not planted & {entry.path for entry in code.entries}
    assert "old-runs/train-20250101-000000-ab/" in code.left_out
    assert ".ssh/id_ed25519" in code.left_out


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home directory of the user's, with keys and an earlier job in it, as ``$HOME``."""
    folder = tmp_path / "home" / "ada"
    folder.mkdir(parents=True)
    plant_secrets(folder)
    (folder / "train.py").write_text("")
    monkeypatch.setenv("HOME", str(folder))
    return folder.resolve()


def test_a_script_lying_in_the_home_directory_is_never_snapshotted(home: Path) -> None:
    with pytest.raises(SnapshotError) as caught:
        snapshot.survey(home / "train.py", home / "hpc-elastic-runs", max_mb=100)
    message = str(caught.value)
    assert message.startswith(f"The code snapshot would copy the whole home directory '{home}'")
    assert "give --snapshot-root DIR" in message
    assert message.endswith("or submit with --no-snapshot.")
    assert message.count(". ") == 0


def test_the_snapshot_root_may_name_neither_a_home_nor_a_place_without_the_script(
    home: Path, tmp_path: Path
) -> None:
    with pytest.raises(SnapshotError, match="--snapshot-root names"):
        snapshot.survey(home / "train.py", home / "runs", max_mb=100, root=home)
    with pytest.raises(SnapshotError, match="whole home directory"):
        snapshot.survey(home / "train.py", home / "runs", max_mb=100, root=Path("/"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with pytest.raises(SnapshotError, match="does not hold the script"):
        snapshot.survey(home / "train.py", home / "runs", max_mb=100, root=elsewhere)


def test_the_snapshot_root_names_the_directory_to_copy(home: Path, tmp_path: Path) -> None:
    project = home / "work" / "llm"
    (project / "src").mkdir(parents=True)
    (project / "src" / "train.py").write_text("import model\n")
    (project / "model.py").write_text("")
    (project / ".netrc").write_text("machine x password y")
    code = snapshot.survey(project / "src" / "train.py", home / "runs", max_mb=100, root=project)
    assert {entry.path for entry in code.entries} == {"src/train.py", "model.py"}
    assert code.left_out == (".netrc",)


def test_through_the_cli_a_home_directory_is_one_error_line_and_nothing_written(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner  # noqa: PLC0415

    from hpc_elastic import cli  # noqa: PLC0415

    monkeypatch.chdir(home)
    result = CliRunner().invoke(cli.app, ["submit", "train.py"], env={"HOME": str(home)})
    assert result.exit_code == 2
    assert result.stderr.startswith("error: The code snapshot would copy the whole home ")
    assert "--snapshot-root" in result.stderr
    assert "--no-snapshot" in result.stderr
    assert result.stderr.count("\n") == 1
    assert not (home / "hpc-elastic-runs").exists()


def test_too_many_files_are_refused_naming_where_most_of_them_are(project: Path) -> None:
    (project / "cache").mkdir()
    for index in range(60):
        (project / "cache" / f"{index}.json").write_text("{}")
    with pytest.raises(SnapshotError) as caught:
        snapshot.survey(project / "train.py", project / "runs", max_mb=100, max_files=50)
    message = str(caught.value)
    assert "would hold 63 files, over the 50-file cap; most are in 'cache/' (60)" in message
    assert "raise --snapshot-max-files" in message


def test_a_plain_directory_of_many_small_files_stops_the_walk_at_the_cap(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "plain"
    (folder / "data").mkdir(parents=True)
    (folder / "train.py").write_text("")
    for index in range(200):
        (folder / "data" / f"{index}.txt").write_text("")
    with pytest.raises(SnapshotError, match="would hold more than 100 files, over the 100-file"):
        snapshot.survey(folder / "train.py", folder / "runs", max_mb=100, max_files=100)


def test_submit_says_what_it_left_out_as_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner  # noqa: PLC0415

    from hpc_elastic import cli  # noqa: PLC0415

    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "train.py").write_text("")
    plant_secrets(folder)
    monkeypatch.chdir(folder)
    with mocked_submit():
        result = CliRunner().invoke(cli.app, ["submit", "train.py"])
    assert result.exit_code == 0, result.stderr
    assert (
        "Left out of the snapshot as secrets: .aws/, .config/gcloud/, .gnupg/, "
        ".hpc-elastic/, .local/state/hpc-elastic/ and 5 more\n"
    ) in result.stdout


def test_an_index_or_user_secret_the_environment_puts_in_the_project_leaves_only_itself_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "train.py").write_text("")
    (folder / "index").write_text("/old/job\n")
    (folder / "my-secret").write_text("user secret")
    monkeypatch.setenv("HPC_ELASTIC_INDEX", str(folder / "index"))
    monkeypatch.setenv("HPC_ELASTIC_USER_SECRET_FILE", str(folder / "my-secret"))
    code = snapshot.survey(folder / "train.py", folder / "runs", max_mb=100)
    assert [entry.path for entry in code.entries] == ["train.py"]
