"""Hostile input: random and malicious values for every option, config field and znode.

Bad input must read like a bad flag (exit 2, one ``error:`` line), never a traceback or an
internal error; values that are accepted must reach the job exactly as given, with nothing
of them executed by the sbatch script or by Jinja; garbage in the rendezvous's znodes must
end in a clear RendezvousError, not a crash.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from cluster import REPO, Cluster
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from kazoo.client import KazooClient
from test_cli import workdir  # noqa: F401 (the CLI tests' project directory, as cwd)
from typer.testing import CliRunner

from hpc_elastic import cli
from hpc_elastic.config import _KEYS as CONFIG_KEYS
from hpc_elastic.errors import RendezvousError
from hpc_elastic.rendezvous import state

pytestmark = pytest.mark.usefixtures("workdir")
runner = CliRunner()
FAST = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

TRICKY = (
    "",
    " ",
    "-1",
    "0",
    "1:0",
    "4:2",
    "nan",
    "inf",
    "-inf",
    "1e309",
    "99999999999999999999",
    "$(touch /tmp/pwned)",
    "`id`",
    "a; rm -rf /",
    "a\nb",
    "a\rb",
    "x' y",
    '"',
    "{{ 7 * 7 }}",
    "{% raw %}",
    "{# c #}",
    "\x1b[31mred",
    "\u202eevil",
    "🙂",
    "--help",
    "=",
    "A=",
    "A=b\nc",
)
hostile_text = st.one_of(
    st.sampled_from(TRICKY), st.text(st.characters(exclude_characters="\0"), max_size=40)
)
VALUE_OPTIONS = tuple(
    "--sbatch-arg" if key == "sbatch-args" else f"--{key}"
    for key in CONFIG_KEYS
    if key != "requeue"
)


def render(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(cli.app, ["render", *args])
    return result.exit_code, result.stdout, result.stderr


def assert_usage_error_or_script(code: int, out: str, err: str) -> None:
    """Either a script, or exit 2 with exactly one ``error:`` line and no traceback."""
    if code == 0:
        assert out.startswith("#!/bin/bash\n"), out
        return
    assert code == 2, err
    assert err.startswith("error: "), err
    assert err.count("\n") == 1, f"not one line: {err!r}"
    assert "Traceback" not in err
    assert "Internal error" not in err


@FAST
@given(option=st.sampled_from(VALUE_OPTIONS), value=hostile_text)
def test_any_value_of_any_option_is_a_script_or_one_usage_line(option: str, value: str) -> None:
    assert_usage_error_or_script(*render(f"{option}={value}", "train.py"))


def toml_value(value: object) -> str:
    """TOML for a few Python types; json's string escapes are TOML's too."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=True)
    return repr(value)


toml_values = st.recursive(
    st.one_of(
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**63 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        hostile_text,
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(
            st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True), children, max_size=3
        ),
    ),
    max_leaves=5,
)


@FAST
@given(
    key=st.one_of(st.sampled_from(sorted(CONFIG_KEYS)), st.just("no-such-key")), value=toml_values
)
def test_any_config_field_value_is_a_script_or_one_usage_line(key: str, value: object) -> None:
    Path("hpc-elastic.toml").write_text(f"{json.dumps(key)} = {toml_value(value)}\n")
    assert_usage_error_or_script(*render("train.py"))


@FAST
@given(garbage=st.binary(max_size=200))
def test_a_config_file_that_is_not_toml_is_one_usage_line(garbage: bytes) -> None:
    Path("hpc-elastic.toml").write_bytes(garbage)
    assert_usage_error_or_script(*render("train.py"))


FAKE_SRUN = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["CAPTURE"], "w") as out:
    json.dump({"argv": sys.argv[1:], "env": dict(os.environ)}, out)
"""

payloads = st.one_of(
    st.sampled_from(TRICKY),
    st.text(st.characters(exclude_characters="\0", codec="utf-8"), max_size=30),
)


@pytest.fixture
def fake_srun(tmp_path: Path) -> Path:
    """An ``srun`` that only records the argv and environment the script gave it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def run_script(script: str, bin_dir: Path) -> dict[str, object]:
    """Run the rendered script under bash as Slurm would, with the fake srun; what srun got."""
    capture = Path.cwd() / "capture.json"
    capture.unlink(missing_ok=True)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CAPTURE": str(capture), "HOME": "/tmp"}
    env["SLURM_ARRAY_TASK_ID"] = "0"
    result = subprocess.run(
        ["bash", "-c", script],
        env=env,
        cwd=capture.parent,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    captured: dict[str, object] = json.loads(capture.read_text())
    return captured


@FAST
@given(value=payloads, args=st.lists(payloads, max_size=3), jinja=st.sampled_from(TRICKY[-12:]))
def test_env_values_and_script_arguments_reach_the_job_verbatim(
    fake_srun: Path, value: str, args: list[str], jinja: str
) -> None:
    assume(not any(arg.startswith("-") for arg in args))  # typer would read them as options
    setup = f"echo {jinja!r} > /dev/null" if "\n" not in jinja and "\r" not in jinja else "true"
    code, script, err = render(
        "--nodes=1:2", f"--env=HOSTILE={value}", f"--setup={setup}", "train.py", "--", *args
    )
    if code != 0:
        assert_usage_error_or_script(code, script, err)
        return
    assert (setup in script) == setup.isprintable()
    captured = run_script(script, fake_srun)
    argv = captured["argv"]
    assert isinstance(argv, list)
    assert argv[argv.index("--") + 1 :][-len(args) - 2 :] == [
        "-u",
        str(Path.cwd() / "train.py"),
        *args,
    ]
    env = captured["env"]
    assert isinstance(env, dict)
    assert env["HOSTILE"] == value
    assert not Path("/tmp/pwned").exists()


def test_jinja_in_values_stays_text() -> None:
    code, script, _ = render(
        "--env=A={{ 7 * 7 }}", "--setup=echo '{% raw %}{{ x }}'", "train.py", "--", "{{ 7 * 7 }}"
    )
    assert code == 0
    assert "49" not in script
    assert "{% raw %}{{ x }}" in script
    assert "export A='{{ 7 * 7 }}'\n" in script
    assert "train.py '{{ 7 * 7 }}'" in script


@given(
    data=st.one_of(
        st.binary(max_size=300),
        st.sampled_from(
            [
                b"{}",
                b"null",
                b"[]",
                b'{"format": 999}',
                b'{"format": 1, "members": "x"}',
                json.dumps({"format": "1", "round": [1]}).encode(),
                b"\xff\xfe",
                b"9" * 100_000,
                b"[" * 100_000 + b"]" * 100_000,
                json.dumps({"format": 1, "x": "y" * 1_000_000}).encode(),
                b'{"a":' * 5000,
            ]
        ),
    )
)
@settings(max_examples=80, deadline=None)
def test_garbage_in_the_state_znode_is_a_rendezvous_error(data: bytes) -> None:
    state.decode.cache_clear()
    message = refusal(state.decode, data)
    assert "\n" not in message
    assert len(message) < 400


@given(
    data=st.one_of(
        st.binary(max_size=300),
        st.sampled_from(
            [
                b"{}",
                b"[]",
                b"[" * 100_000,
                b'{"node_id": 1}',
                b'{"a":' * 5000,
                b'"' + b"x" * 1_000_000 + b'"',
            ]
        ),
    )
)
@settings(max_examples=80, deadline=None)
def test_garbage_in_a_member_znode_is_a_rendezvous_error(data: bytes) -> None:
    message = refusal(state.decode_node, data)
    assert "\n" not in message
    assert len(message) < 400


@pytest.mark.integration
@pytest.mark.parametrize("garbage", [b"not json", b"[" * 100_000, b'{"format": 999}'])
def test_an_agent_facing_a_garbage_state_fails_with_one_line(
    cluster: Cluster, zk_root: str, tmp_path: Path, garbage: bytes
) -> None:
    client = KazooClient(hosts=cluster.zk_hosts)
    client.start(timeout=10)
    try:
        client.create(f"{zk_root}/hpc-elastic/run/state", garbage, makepath=True)
    finally:
        client.stop()
        client.close()
    agent = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpc_elastic",
            "agent",
            "--run-id=run",
            f"--job-dir={tmp_path}",
            f"--zk={cluster.zk_hosts}{zk_root}",
            "--nodes=1",
            "--slot=0",
            "--host=127.0.0.1",
            "--",
            sys.executable,
            "-c",
            "pass",
        ],
        env={**cluster.env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert agent.returncode == 1, agent.stderr
    assert "is not a hpc-elastic state" in agent.stderr
    assert "Traceback" not in agent.stderr


def refusal(decode: Callable[[bytes], object], data: bytes) -> str:
    """The RendezvousError's message, or "" where the data decoded (then it was well formed)."""
    try:
        decode(data)
    except RendezvousError as error:
        return str(error)
    return ""
