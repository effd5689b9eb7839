"""The per-job secret file: created private, refused when others could read it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_elastic.errors import RendezvousError, UsageError
from hpc_elastic.rendezvous.secret import (
    create_secret_file,
    read_secret_file,
    require_secret,
    user_secret,
)


def test_created_secret_is_private_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "job" / "zk-secret"
    secret = create_secret_file(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_secret_file(path) == secret
    assert len(secret) >= 40


def test_an_existing_file_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "zk-secret"
    create_secret_file(path)
    with pytest.raises(UsageError, match="already exists"):
        create_secret_file(path)


def test_a_file_others_can_read_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "zk-secret"
    path.write_text("abc\n")
    path.chmod(0o644)
    with pytest.raises(UsageError, match=r"mode 0644.*chmod 600"):
        read_secret_file(path)


def test_a_missing_file_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(RendezvousError, match="check --zk-auth-file"):
        read_secret_file(tmp_path / "nope")


def test_a_job_without_a_secret_is_refused_with_both_ways_out() -> None:
    with pytest.raises(
        UsageError, match=r"'run-7' has no ZooKeeper secret.*--zk-auth-file.*--zk-open-acl"
    ):
        require_secret(None, "run-7", open_acl=False)


def test_a_secret_or_an_explicit_open_acl_is_accepted() -> None:
    require_secret("s3cret", "run-7", open_acl=False)
    require_secret(None, "run-7", open_acl=True)


def test_the_users_secret_is_created_private_once_and_then_read_back(tmp_path: Path) -> None:
    path = tmp_path / "home" / ".hpc-elastic" / "user-secret"
    first = user_secret(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert user_secret(path) == first


def test_a_users_secret_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "user-secret"
    user_secret(path)
    path.chmod(0o644)
    with pytest.raises(UsageError, match="chmod 600"):
        user_secret(path)
