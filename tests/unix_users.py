"""A second Unix user for the filesystem attacks, and a place on disk both users can reach.

The attacker is a real unprivileged account (``hpce-mallory``), made with ``useradd`` the first
time a session needs it; its commands run through ``subprocess`` with ``user=``/``group=`` and
no supplementary groups, so the kernel, not the test, decides what it may do. Making an
account needs root: CI runs as root; elsewhere the tests that need one fail under ``CI=true``
and skip, with the reason, otherwise (as a missing cluster does, see conftest.py).

The account is left in place at the end of the session: a system account without a home
or a shell, and another pytest session running beside this one (scripts/test-all runs two)
may still be using it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ATTACKER = "hpce-mallory"


@dataclass(frozen=True)
class UnixUser:
    """An unprivileged account that runs shell commands as itself."""

    name: str
    uid: int
    gid: int

    def sh(self, script: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``script`` under ``sh -c`` as this user; fails the test if it fails."""
        result = subprocess.run(
            ["sh", "-ec", script],
            user=self.uid,
            group=self.gid,
            extra_groups=[],
            env={"PATH": "/usr/bin:/bin", "HOME": "/", "LC_ALL": "C"},
            cwd=cwd or "/",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, f"{self.name} could not run {script!r}: {result.stderr}"
        return result


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _account(name: str) -> UnixUser:
    """``name``'s account, made now (system account, own group, no home) if it is missing."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        made = subprocess.run(
            ["useradd", "--system", "--user-group", "--no-create-home", "--shell",
             "/usr/sbin/nologin", name],
            capture_output=True, text=True, check=False, timeout=60,
        )  # fmt: skip
        # Exit 9: another session made it meanwhile; any other failure shows below.
        if made.returncode not in (0, 9):
            pytest.fail(f"useradd {name} failed: {made.stderr.strip()}", pytrace=False)
        entry = pwd.getpwnam(name)
    return UnixUser(name, entry.pw_uid, entry.pw_gid)


@pytest.fixture(scope="session")
def mallory() -> UnixUser:
    """The attacker: another unprivileged user of the machine.

    The product runs as the test's own user (root in CI) and mallory attacks. That exercises
    the real checks: each of them compares an owner with the running user and reads mode
    bits itself, never asking ``access(2)`` (which would answer "yes" to root), so root
    refuses mallory's files exactly as an ordinary user would. Running the product as a
    second unprivileged user instead would need the repository and its virtual environment
    readable by that user, which a CI checkout under /root is not.
    """
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        message = "the filesystem attacks need root and useradd to make a second Unix user"
        if _in_ci():
            pytest.fail(f"{message}; CI runs as root and must run them", pytrace=False)
        pytest.skip(message)
    return _account(ATTACKER)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory both users can reach (``/tmp/...``, 0755, the test's own), with
    ``project/`` inside it that everyone may write and that has no sticky bit: a group
    project directory, as the attacks assume. pytest's ``tmp_path`` will not do: it lies in a
    0700 directory the attacker cannot enter."""
    base = Path(tempfile.mkdtemp(prefix="hpc-elastic-shared-"))
    try:
        base.chmod(0o755)
        project = base / "project"
        project.mkdir()
        project.chmod(0o777)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)
