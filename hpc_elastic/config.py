"""The one reader of the config file and of the HPC_ELASTIC_* variables.

Defaults for ``submit`` come from ``hpc-elastic.toml``, or from ``[tool.hpc-elastic]`` in a
``pyproject.toml``, whichever is found first searching from the working directory upwards. The
search stops at the project root (a directory holding ``.git`` or ``pyproject.toml``) or at
``$HOME``: on a shared filesystem the directories above those belong to other people, and a
file planted there must not choose our template or ``--setup`` lines. A file that another user
owns, or that group or others may write, is refused as git's ``safe.directory`` refuses one.
Keys are the long flags without ``--`` (``nproc-per-node = 4``); each value goes through the
same parser as its flag, so a bad value in the file reads like a bad flag, prefixed with the
file's path. Relative paths in the file are relative to the file, not to the working directory.
"""

from __future__ import annotations

import logging
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hpc_elastic.contract import DEFAULT_ZK, ZK_ENV
from hpc_elastic.errors import ConfigError, UsageError
from hpc_elastic.options import ConfigReader, WrongTypeError, config_readers
from hpc_elastic.spec import parse_zk
from hpc_elastic.trust import unsafe_file_reason

CONFIG_FILE = "hpc-elastic.toml"
PYPROJECT_FILE = "pyproject.toml"
PROJECT_MARKERS = (".git", PYPROJECT_FILE)
"""What makes a directory a project root, where the search for a config file ends."""
__all__ = ["DEFAULT_ZK", "ZK_ENV", "Config", "find_config", "load_config"]
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Config:
    """Parsed defaults keyed by JobSpec field name; ``path`` is None when no file was found."""

    path: Path | None = None
    values: Mapping[str, object] = field(default_factory=dict)


def find_config(start: Path, home: Path | None = None, uid: int | None = None) -> Path | None:
    """The nearest hpc-elastic.toml, or pyproject.toml with a [tool.hpc-elastic] table.

    Only ``start`` and its parents up to the project root or ``home`` are searched; a file
    found there must pass ``unsafe_config_reason`` for ``uid`` (default: this process's user).
    """
    home = Path.home() if home is None else home
    uid = os.geteuid() if uid is None else uid
    for directory in search_directories(start, home):
        candidate = directory / CONFIG_FILE
        if candidate.is_file():
            return _trusted(candidate, uid)
        pyproject = directory / PYPROJECT_FILE
        if pyproject.is_file() and _hpc_elastic_table(_read_toml(pyproject)) is not None:
            return _trusted(pyproject, uid)
    return None


def search_directories(start: Path, home: Path) -> list[Path]:
    """``start`` and its parents, ending with the first project root or ``home`` on the way."""
    directories = []
    for directory in (start, *start.parents):
        directories.append(directory)
        if directory == home or any((directory / marker).exists() for marker in PROJECT_MARKERS):
            break
    return directories


unsafe_config_reason = unsafe_file_reason
"""Why a config file with this owner and mode must not be trusted: anyone else's file, or one
that group or others may rewrite, could name a template or setup lines that would run as us.
The one rule for every file we act on (``hpc_elastic.trust``), templates included."""


def _trusted(path: Path, uid: int) -> Path:
    info = path.stat()
    reason = unsafe_config_reason(info.st_uid, info.st_mode, uid)
    if reason is not None:
        _log.debug("refusing config file %s: %s", path, reason)
        raise ConfigError(
            f"Config file '{path}' is not trusted because {reason}; remove it, or make it "
            "yours and writable only by you (chmod go-w)."
        )
    _log.debug("using config file %s", path)
    return path


def load_config(
    start: Path,
    environ: Mapping[str, str] = os.environ,
    home: Path | None = None,
    uid: int | None = None,
) -> Config:
    """Read the defaults that apply in ``start``; the environment beats the file."""
    path = find_config(start.absolute(), home, uid)
    values: dict[str, object] = {}
    if path is not None:
        table: object = _read_toml(path)
        if path.name == PYPROJECT_FILE:
            table = _hpc_elastic_table(table)
        values = _convert(table, path)
    if environ.get(ZK_ENV):
        try:
            values["zk"] = parse_zk(environ[ZK_ENV])
        except UsageError as err:
            raise ConfigError(f"{ZK_ENV}: {err}") from err
    return Config(path, values)


def _hpc_elastic_table(document: object) -> object:
    tool = document.get("tool") if isinstance(document, dict) else None
    return tool.get("hpc-elastic") if isinstance(tool, dict) else None


def _read_toml(path: Path) -> dict[str, object]:
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid TOML ({err}); fix the file.") from err
    except OSError as err:
        raise ConfigError(
            f"{path} cannot be read ({err.strerror}); check its permissions."
        ) from err


def _convert(table: object, path: Path) -> dict[str, object]:
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: the hpc-elastic settings must be a table; fix the file.")
    values: dict[str, object] = {}
    for key, raw in table.items():
        converter = _KEYS.get(key)
        if converter is None:
            raise ConfigError(
                f"{path}: unknown key '{key}'; use one of {', '.join(sorted(_KEYS))}."
            )
        try:
            values[key.replace("-", "_")] = converter(raw, path.parent)
        except WrongTypeError as err:
            raise ConfigError(f"{path}: key '{key}' {err}") from err
        except UsageError as err:
            raise ConfigError(f"{path}: key '{key}' is invalid: {err}") from err
    return values


_KEYS: dict[str, ConfigReader] = config_readers()
"""Config key -> reader, derived from the option table (``hpc_elastic.options``)."""
