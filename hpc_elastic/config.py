"""The one reader of the config file and of the HPC_ELASTIC_* variables.

Defaults for ``submit`` come from ``hpc-elastic.toml``, or from ``[tool.hpc-elastic]`` in a
``pyproject.toml``, whichever is found first searching from the working directory upwards.
Keys are the long flags without ``--`` (``nproc-per-node = 4``); each value goes through the
same parser as its flag, so a bad value in the file reads like a bad flag, prefixed with the
file's path. Relative paths in the file are relative to the file, not to the working directory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from hpc_elastic.errors import ConfigError, UsageError
from hpc_elastic.spec import (
    NodeRange,
    PreemptSignal,
    parse_env,
    parse_job_name,
    parse_mem,
    parse_positive,
    parse_sbatch_arg,
    parse_sbatch_value,
    parse_setup_line,
    parse_time,
    parse_zk,
)

CONFIG_FILE = "hpc-elastic.toml"
PYPROJECT_FILE = "pyproject.toml"
ZK_ENV = "HPC_ELASTIC_ZK"
DEFAULT_ZK = "127.0.0.1:2181"

_Converter = Callable[[object, Path], object]


@dataclass(frozen=True)
class Config:
    """Parsed defaults keyed by JobSpec field name; ``path`` is None when no file was found."""

    path: Path | None = None
    values: Mapping[str, object] = field(default_factory=dict)


def find_config(start: Path) -> Path | None:
    """The nearest hpc-elastic.toml, or pyproject.toml with a [tool.hpc-elastic] table."""
    for directory in (start, *start.parents):
        candidate = directory / CONFIG_FILE
        if candidate.is_file():
            return candidate
        pyproject = directory / PYPROJECT_FILE
        if pyproject.is_file() and _hpc_elastic_table(_read_toml(pyproject)) is not None:
            return pyproject
    return None


def load_config(start: Path, environ: Mapping[str, str] = os.environ) -> Config:
    """Read the defaults that apply in ``start``; the environment beats the file."""
    path = find_config(start.absolute())
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
        except _WrongTypeError as err:
            raise ConfigError(f"{path}: key '{key}' {err}") from err
        except UsageError as err:
            raise ConfigError(f"{path}: key '{key}' is invalid: {err}") from err
    return values


class _WrongTypeError(UsageError):
    """A value of the wrong TOML type; _convert adds which file and key."""


def _wrong_type(expected: str, value: object) -> _WrongTypeError:
    return _WrongTypeError(
        f"must be {expected}, not {type(value).__name__} {value!r}; fix the config file."
    )


def _text(parse: Callable[[str], object], *, numbers: bool = False) -> _Converter:
    """A string value (or a bare number, for keys like ``nodes = 4`` and ``time = 60``)."""

    def convert(value: object, _base: Path) -> object:
        if numbers and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise _wrong_type("a string", value)
        return parse(value)

    return convert


def _count(option: str, *, zero_ok: bool = False) -> _Converter:
    def convert(value: object, _base: Path) -> object:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _wrong_type("an integer", value)
        return parse_positive(option, value, zero_ok=zero_ok)

    return convert


def _seconds(option: str) -> _Converter:
    def convert(value: object, _base: Path) -> object:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _wrong_type("a number of seconds", value)
        if value < 0:
            raise UsageError(f"{option} '{value}' is negative; give 0 or more seconds.")
        return float(value)

    return convert


def _flag(value: object, _base: Path) -> object:
    if not isinstance(value, bool):
        raise _wrong_type("true or false", value)
    return value


def _path(value: object, base: Path) -> object:
    if not isinstance(value, str):
        raise _wrong_type("a path string", value)
    return base / Path(value).expanduser()


def _lines(parse: Callable[[str], str]) -> _Converter:
    def convert(value: object, _base: Path) -> object:
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise _wrong_type("a list of strings", value)
        return tuple(parse(item) for item in value)

    return convert


def _environment(value: object, _base: Path) -> object:
    if not isinstance(value, dict) or not all(
        isinstance(item, str | int | float) and not isinstance(item, bool)
        for item in value.values()
    ):
        raise _wrong_type('a table of KEY = "value"', value)
    return tuple(parse_env(f"{key}={item}") for key, item in value.items())


def _word(option: str) -> _Converter:
    return _text(lambda text: parse_sbatch_value(option, text))


_KEYS: dict[str, _Converter] = {
    "nodes": _text(NodeRange.parse, numbers=True),
    "nproc-per-node": _count("--nproc-per-node"),
    "job-name": _text(parse_job_name),
    "partition": _word("--partition"),
    "account": _word("--account"),
    "qos": _word("--qos"),
    "time": _text(parse_time, numbers=True),
    "gpus-per-node": _count("--gpus-per-node"),
    "cpus-per-task": _count("--cpus-per-task"),
    "mem": _text(parse_mem, numbers=True),
    "constraint": _word("--constraint"),
    "exclude": _word("--exclude"),
    "requeue": _flag,
    "signal": _text(PreemptSignal.parse),
    "setup": _lines(parse_setup_line),
    "env": _environment,
    "log-dir": _path,
    "template": _path,
    "max-restarts": _count("--max-restarts", zero_ok=True),
    "zk": _text(parse_zk),
    "python": _text(str),
    "sbatch-args": _lines(parse_sbatch_arg),
    "hang-timeout": _seconds("--hang-timeout"),
    "last-call": _seconds("--last-call"),
    "session-timeout": _seconds("--session-timeout"),
    "min-wait": _seconds("--min-wait"),
    "max-preemptions": _count("--max-preemptions", zero_ok=True),
    "max-time-limits": _count("--max-time-limits", zero_ok=True),
    "exclude-after": _count("--exclude-after"),
    "prewarm": _flag,
}
