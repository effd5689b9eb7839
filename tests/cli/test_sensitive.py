"""Secrets on command lines: ``ps`` shows every user what ``submit`` was given.

``--env-file`` and ``--notify-file`` (or ``$HPC_ELASTIC_NOTIFY_URL``) keep tokens off the
command line; files that hold them are checked like the config file and must be private; a
token typed as a flag anyway gets one warning. The attacks are run by a real second Unix user
(``mallory``, tests/unix_users.py) reading ``ps`` while a real ``submit`` process runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from cluster import REPO
from slurm_fake import mocked_submit
from unix_users import UnixUser, mallory, shared

from hpc_elastic import cli
from hpc_elastic.contract import NOTIFY_URL_ENV
from hpc_elastic.sensitive import command_line_findings, token_reason

__all__ = ["mallory", "shared"]  # fixtures, imported for pytest to find

runner = CliRunner()
DEADLINE = 60.0
HF_TOKEN = "hf_" + "Qx7LmB2pZ9rT4vW8kS1nB6hY3dF5gJ0cE"
HOOK = "https://hooks.slack.com/services/T0ABCDEF1/B0ABCDEF2/Xq7Lm2Pz9Rt4Vw8Ks1Nb6Hy3"


# --- what looks like a token ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "name", "why"),
    [
        (HF_TOKEN, None, "starts with 'hf_'"),
        ("HF_TOKEN=" + HF_TOKEN, None, "starts with 'hf_'"),
        ("ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8", None, "starts with 'ghp_'"),
        ("xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx", None, "'xoxb-'"),
        ("AKIAIOSFODNN7EXAMPLE", None, "starts with 'AKIA'"),
        ("sk-proj-" + "Ab3dEf6hIj9lMn2pQr5tUv8x", None, "starts with 'sk-'"),
        ("WANDB_API_KEY=" + "3f1c2a9d8e07b4c1a2d3e4f5a6b7c8d9e0f1a2b3", None, "'WANDB_API_KEY'"),
        ("hunter22", "--db-password", "'--db-password'"),
        ("https://ada:pa55word@example.com/data", None, "holds a password"),
        ("https://example.com/hook?token=abc", None, "query holds 'token'"),
        ("https://s3.example.com/b/o?X-Amz-Signature=abc", None, "'X-Amz-Signature'"),
        (HOOK, None, "long random part"),
        ("Xq7Lm2Pz9Rt4Vw8Ks1Nb6Hy3Jd5Fc0Ga", None, "long random string"),
    ],
)
def test_tokens_are_recognised_by_prefix_name_url_or_randomness(
    value: str, name: str | None, why: str
) -> None:
    reason = token_reason(value, name)
    assert reason is not None
    assert why in reason


@pytest.mark.parametrize(
    "value",
    [
        "train.py",
        "OMP_NUM_THREADS=8",
        "--lr=3e-4",
        "mistralai/Mixtral-8x7B-Instruct-v0.1",
        "sentence-transformers/all-MiniLM-L6-v2",
        "ResNet50_ImageNet_Final_v2",
        "checkpoint_step_000123456",
        "3f1c2a9d8e07b4c1a2d3e4f5a6b7c8d9e0f1a2b3",  # a git commit
        "train-20261129-101500-" + "ab" * 16,  # a run id
        "/home/ada/Project/data/Shard0001/x.bin",
        "s3://my-Bucket-2024/checkpoints/RunA1B2",
        "https://hooks.example.com/T000/B000",
        "HF_TOKEN_FILE=/run/secrets/hf",  # names a secret, but is a path to one
        "sk-learn",
        "hf_hub_download_with_retries",
    ],
)
def test_names_paths_model_ids_and_hex_ids_are_no_tokens(value: str) -> None:
    assert token_reason(value) is None


def test_a_script_flag_named_like_a_secret_is_judged_with_its_name() -> None:
    argv = ["submit", "--env", "A=b", "train.py", "--", "--api-key", "abc123", "--lr", "0.1"]
    [finding] = command_line_findings(argv, ["--env"])
    assert (finding.where, finding.shown) == ("the script's arguments", "abc1…")


# --- --env-file and --notify-file -------------------------------------------------------------


def private_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def render(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = runner.invoke(cli.app, ["render", *args], env=env)
    return result.exit_code, result.stdout, result.stderr


def test_an_env_file_exports_its_variables_and_a_flag_wins_for_its_key(workdir: Path) -> None:
    private_file(
        workdir / "secrets.env",
        f"# tokens\nexport HF_TOKEN={HF_TOKEN}\nWANDB_API_KEY='abc def'\n\nSEED=1\n",
    )
    code, script, err = render("--env-file", "secrets.env", "--env", "SEED=2", "train.py")
    assert code == 0, err
    assert f"export HF_TOKEN={HF_TOKEN}\n" in script
    assert "export WANDB_API_KEY='abc def'\n" in script
    assert "export SEED=2\n" in script
    assert err == ""  # nothing on the command line looks like a token


def test_the_config_file_may_name_the_env_file_relative_to_itself(workdir: Path) -> None:
    (workdir / "conf").mkdir()
    private_file(workdir / "conf" / "job.env", f"HF_TOKEN={HF_TOKEN}\n")
    (workdir / "hpc-elastic.toml").write_text('env-file = "conf/job.env"\n')
    code, script, err = render("train.py")
    assert code == 0, err
    assert f"export HF_TOKEN={HF_TOKEN}\n" in script


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o620, 0o602])
def test_an_env_file_that_others_may_read_or_write_is_refused_without_showing_it(
    workdir: Path, mode: int
) -> None:
    private_file(workdir / "secrets.env", f"HF_TOKEN={HF_TOKEN}\n", mode)
    code, _, err = render("--env-file", "secrets.env", "train.py")
    assert code == 2
    assert err.startswith("error: --env-file 'secrets.env' is not trusted because group or ")
    assert "chmod 600" in err
    assert err.count("\n") == 1
    assert HF_TOKEN not in err


def test_a_bad_env_file_line_is_named_by_its_number_never_by_its_value(workdir: Path) -> None:
    private_file(workdir / "secrets.env", f"A=1\n{HF_TOKEN}\n")
    code, _, err = render("--env-file", "secrets.env", "train.py")
    assert code == 2
    assert "line 2 is not KEY=VALUE" in err
    assert HF_TOKEN[3:] not in err


def test_the_webhook_comes_from_a_file_or_the_environment_never_two_places(
    workdir: Path,
) -> None:
    private_file(workdir / "hook.url", f"# the team's channel\n{HOOK}\n")
    code, script, err = render("--notify-file", "hook.url", "train.py")
    assert (code, err) == (0, "")
    assert f"export {NOTIFY_URL_ENV}={HOOK}\n" in script
    code, script, err = render("train.py", env={NOTIFY_URL_ENV: HOOK})
    assert (code, err) == (0, "")
    assert f"export {NOTIFY_URL_ENV}={HOOK}\n" in script
    code, _, err = render("--notify-file", "hook.url", "train.py", env={NOTIFY_URL_ENV: HOOK})
    assert code == 2
    assert err.startswith("error: --notify-file 'hook.url' and a --notify URL")


def test_a_token_typed_as_a_flag_gets_one_warning_line_that_names_the_way_out(
    workdir: Path,
) -> None:
    code, script, err = render(
        "--env", f"HF_TOKEN={HF_TOKEN}", "--notify", HOOK, "train.py", "--", "--seed", "1"
    )
    assert code == 0
    assert script.startswith("#!/bin/bash\n")
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("warning: The value 'HF_TOKEN=hf_Q…' of --env looks like a secret")
    assert "--env-file" in lines[0]
    assert lines[1].startswith(
        "warning: The value 'https://hooks.slack.com/…' of --notify looks like a secret"
    )
    assert f"--notify-file FILE (mode 0600), or in the variable {NOTIFY_URL_ENV}" in lines[1]
    assert HF_TOKEN[3:] not in err
    assert "Xq7Lm2Pz" not in err


# --- the attack: another user reads `ps` while submit runs --------------------------------------

FAKE_SBATCH = """#!/bin/sh
# Holds submit at sbatch, as a slow slurmctld does, until the test has looked.
cat > /dev/null
while [ ! -e "$RELEASE" ]; do sleep 0.05; done
echo 4242
"""


class HeldSubmit:
    """A real ``hpc-elastic submit`` process, held inside its sbatch call until ``release``."""

    def __init__(self, workdir: Path, args: list[str], environment: dict[str, str]) -> None:
        bin_dir = workdir / "bin"
        bin_dir.mkdir()
        sbatch = bin_dir / "sbatch"
        sbatch.write_text(FAKE_SBATCH)
        sbatch.chmod(0o700)
        self.release_file = workdir / "release"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hpc_elastic", "submit", "--no-snapshot", *args],
            cwd=workdir,
            env={
                **os.environ,
                **environment,
                "PATH": f"{bin_dir}:{os.environ['PATH']}",
                "RELEASE": str(self.release_file),
                "PYTHONPATH": str(REPO),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def release(self) -> tuple[int, str, str]:
        self.release_file.touch()
        out, err = self.process.communicate(timeout=DEADLINE)
        return self.process.returncode, out, err

    def seen_by(self, user: UnixUser) -> str:
        """What ``user``'s ``ps`` shows of this process once it shows it at all (the command
        line is complete by then: the kernel fills it in at exec)."""
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.communicate()
            listing = user.sh("ps -eww -o pid=,args=").stdout
            mine = [
                line for line in listing.splitlines() if line.split()[0] == str(self.process.pid)
            ]
            if mine and "hpc_elastic submit" in mine[0]:
                return mine[0]
        pytest.fail(f"{user.name} never saw the submit process in ps")


@pytest.fixture
def held(workdir: Path) -> Iterator[list[HeldSubmit]]:
    started: list[HeldSubmit] = []
    yield started
    for each in started:
        each.release_file.touch()
        if each.process.poll() is None:
            each.process.kill()
        each.process.communicate()


def test_another_user_reads_a_token_typed_as_a_flag_in_ps_so_submit_warns(
    workdir: Path, mallory: UnixUser, held: list[HeldSubmit]
) -> None:
    """The attack itself: mallory copies the token from ``ps``; submit now says so at once."""
    held.append(HeldSubmit(workdir, ["--env", f"HF_TOKEN={HF_TOKEN}", "train.py"], {}))
    assert HF_TOKEN in held[0].seen_by(mallory)
    code, out, err = held[0].release()
    assert code == 0, err
    assert "Submitted batch job 4242" in out
    assert "warning: The value 'HF_TOKEN=hf_Q…' of --env looks like a secret" in err


def test_with_an_env_file_and_the_hook_in_the_environment_ps_shows_another_user_no_secret(
    workdir: Path, mallory: UnixUser, held: list[HeldSubmit]
) -> None:
    private_file(workdir / "secrets.env", f"HF_TOKEN={HF_TOKEN}\n")
    held.append(
        HeldSubmit(workdir, ["--env-file", "secrets.env", "train.py"], {NOTIFY_URL_ENV: HOOK})
    )
    seen = held[0].seen_by(mallory)
    assert "--env-file secrets.env" in seen
    assert HF_TOKEN not in seen
    assert "Xq7Lm2Pz" not in seen
    environ = mallory.sh(
        f"cat /proc/{held[0].process.pid}/environ 2>/dev/null || echo refused"
    ).stdout
    assert environ.strip() == "refused"  # the hook's URL sits in an environment only we read
    code, out, err = held[0].release()
    assert (code, err) == (0, "")
    job_dir = Path(out.split("Job directory: ")[1].split("\n")[0])
    script = (job_dir / "sbatch.sh").read_text()
    assert f"export HF_TOKEN={HF_TOKEN}\n" in script  # the job has both, in its 0600 script
    assert f"export {NOTIFY_URL_ENV}={HOOK}\n" in script
    assert (job_dir / "sbatch.sh").stat().st_mode & 0o077 == 0


def test_an_env_file_another_user_planted_is_refused(
    workdir: Path, mallory: UnixUser, shared: Path
) -> None:
    """A group project directory: mallory leaves a file where ours is expected; even mode 0600,
    it is hers, so it could set anything in our job (``LD_PRELOAD``, ``PYTHONPATH``)."""
    planted = shared / "project" / "job.env"
    mallory.sh(f"umask 077; echo 'LD_PRELOAD=/tmp/evil.so' > {planted}")
    code, _, err = render("--env-file", str(planted), "train.py")
    assert code == 2
    assert f"is not trusted because it is owned by user id {mallory.uid}, not by you" in err


def test_a_wrong_flag_beside_a_token_is_still_one_error_line(workdir: Path) -> None:
    """A wrong flag is one ``error:`` line even beside a token: warnings come after the plan."""
    code, _, err = render("--env", f"HF_TOKEN={HF_TOKEN}", "--nodes", "0", "train.py")
    assert code == 2
    assert err.startswith("error: --nodes")
    assert err.count("\n") == 1


def test_submit_sends_the_env_files_variables_in_the_script(workdir: Path) -> None:
    """The warnings change nothing else: an env-file job is submitted as before."""
    private_file(workdir / "secrets.env", "A=1\n")
    with mocked_submit() as fake:
        result = runner.invoke(cli.app, ["submit", "--env-file", "secrets.env", "train.py"])
    assert result.exit_code == 0, result.stderr
    assert "export A=1\n" in fake.submitted[0]
