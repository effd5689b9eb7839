"""Object storage for checkpoints, through fsspec; the only module that imports it.

A checkpoint directory may be an fsspec URL such as ``s3://bucket/prefix``. Credentials and
the endpoint come from the usual places of the storage's own library (for S3: the
``AWS_*`` environment variables, ``~/.aws`` profiles, instance roles; ``AWS_ENDPOINT_URL``
for an S3-compatible server), never from a command-line flag that ``ps`` would show.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from hpc_elastic.errors import CheckpointError

log = logging.getLogger(__name__)


def is_url(location: str | Path) -> bool:
    """``s3://…``, ``gs://…`` and the like; a plain or ``file:`` path is not."""
    text = str(location)
    return "://" in text and not text.startswith("file://")


class ObjectStore:
    """The few object operations a checkpoint needs, on keys below one root ``bucket/prefix``.

    Listings are never cached: another writer (or a newer round) may have changed the
    prefix since the last look, and a stale listing could hide a committed checkpoint.
    """

    def __init__(self, url: str) -> None:
        try:
            import fsspec  # noqa: PLC0415  (optional: only object-storage users need it)

            self.fs: Any
            self.fs, self.root = fsspec.core.url_to_fs(url, use_listings_cache=False)
        except ImportError as error:
            raise CheckpointError(
                f"Checkpoint location '{url}' needs {error.name or 'fsspec'}; install "
                f"hpc-elastic[s3] (or the fsspec driver for that scheme)."
            ) from error
        except ValueError as error:
            raise CheckpointError(
                f"Checkpoint location '{url}' is not a usable URL ({error}); use one such as "
                f"s3://bucket/prefix."
            ) from error
        self.root = self.root.rstrip("/")
        self.url = url

    def key(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def put(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(key, data)

    def get(self, key: str) -> bytes:
        data: bytes = self.fs.cat_file(key)
        return data

    def size(self, key: str) -> int:
        return int(self.fs.info(key)["size"])

    def names(self) -> list[str]:
        """The names directly below the root (objects and prefixes alike)."""
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries]

    def exists(self, key: str) -> bool:
        self.fs.invalidate_cache()
        return bool(self.fs.exists(key))

    def remove(self, key: str) -> None:
        """Remove an object or everything below a prefix; gone already is fine."""
        self.fs.invalidate_cache()
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(key, recursive=True)
