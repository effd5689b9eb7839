"""The commit protocol on its own (``hpc_elastic.train.commit``), without a model or a save.

``Checkpointer``'s tests (test_checkpoint.py) run it under the save and load API; these pin
what the protocol does for any writer: a staged step commits under its name with a manifest
that verifies, a writer of an older round is refused, a step committed again keeps one copy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_elastic.errors import CheckpointFencedError
from hpc_elastic.train.commit import MANIFEST_FILE, Commits, verify


def commits(directory: Path, round_: int | None = None, keep: int = 2) -> Commits:
    return Commits(directory, lambda: round_, job="job", keep=keep)


def staged(writer: Commits, step: int, data: bytes = b"state") -> Path:
    staging = writer.prepare_staging(step)
    (staging / "blob").write_bytes(data)
    return writer.commit(staging, step, 1, {"blob": {"size": len(data)}})


def test_a_staged_step_commits_under_its_name_with_a_manifest_that_verifies(
    tmp_path: Path,
) -> None:
    writer = commits(tmp_path)
    staging = writer.prepare_staging(7)
    assert staging.name.startswith(".step-00000007.tmp-")
    assert writer.committed() == []
    (staging / "blob").write_bytes(b"state")
    final = writer.commit(staging, 7, 1, {"blob": {"size": 5}})
    assert final == tmp_path / "step-00000007"
    assert (final / MANIFEST_FILE).exists()
    assert not staging.exists()
    assert verify(final) is None
    assert writer.newest_intact() == final


def test_a_truncated_file_is_not_trusted_and_the_previous_step_is_chosen(tmp_path: Path) -> None:
    writer = commits(tmp_path)
    first = staged(writer, 1)
    second = staged(writer, 2)
    (second / "blob").write_bytes(b"sta")
    assert verify(second) == "blob truncated: 3 of 5 bytes"
    assert writer.newest_intact() == first


def test_a_writer_of_an_older_round_is_refused_once_a_newer_round_claimed_the_directory(
    tmp_path: Path,
) -> None:
    stale, current = commits(tmp_path, round_=3), commits(tmp_path, round_=4)
    stale_staging = stale.prepare_staging(1)
    current.claim_for_load()
    with pytest.raises(CheckpointFencedError, match=r"Round 3 may not commit step 1 .* round 4"):
        stale.commit(stale_staging, 1, 1, {})
    assert not stale_staging.exists(), "a refused commit removes its own staging"
    assert staged(current, 1) == tmp_path / "step-00000001"


def test_a_step_committed_again_keeps_one_copy_and_retention_keeps_the_newest(
    tmp_path: Path,
) -> None:
    writer = commits(tmp_path, keep=2)
    staged(writer, 1)
    staged(writer, 2, b"first")
    again = staged(writer, 2, b"again")
    assert (again / "blob").read_bytes() == b"again"
    staged(writer, 3)
    assert [path.name for path in writer.committed()] == ["step-00000003", "step-00000002"]
    assert not list(tmp_path.glob(".step-*"))
