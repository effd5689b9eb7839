"""Typed decoders for JSON read from places others may write: tables of checks, one per field.

Whatever lies in a znode, a job directory's files or the events file was perhaps not written
by this version of hpc-elastic (or at all by hpc-elastic), so each field is checked for its
type and range before a record is built: a malformed record is one sentence naming the field
and its value, never a crash in a rule that reads it nor a silently coerced value (``str()``
of a list is no host name, ``int(True)`` no count, ``"no"`` not "closed").

A decoder is a table ``{field: check}`` turned into a ``Check`` by ``record``; a check takes
a JSON value and where it is (``members[2].host``) and returns the field's value or raises
``MalformedError``. Each module that decodes turns that into its own error from ``errors.py``
(``RendezvousError``, ``SlurmError``, ...) with what the record is and what to do. Nothing here
does I/O; it is the generic part of the state's decoder (``rendezvous/state.py``), shared.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, Generic, TypeVar, cast

from hpc_elastic.errors import one_line

Decoded = TypeVar("Decoded")


class MalformedError(ValueError):
    """One field of a decoded record has the wrong type or range; the text says which."""


Check = Callable[[object, str], object]
"""A JSON value and where it is (``members[2].host``) -> the field's value; raises
``MalformedError``."""


def shown(value: object, limit: int = 30) -> str:
    """A value quoted for a sentence, at most ``limit`` characters and on one line."""
    quoted = repr(value)
    return one_line(quoted if len(quoted) <= limit else quoted[: limit - 3] + "...")


def whole(low: int, high: int | None = None) -> Check:
    """An integer (never a bool, a float or a string of digits) in ``[low, high]``."""

    def check(value: object, where: str) -> object:
        if type(value) is not int:
            raise MalformedError(f"'{where}' is {shown(value)}, not a whole number")
        if value < low or (high is not None and value > high):
            bounds = f"{low} or more" if high is None else f"from {low} to {high}"
            raise MalformedError(f"'{where}' is {value}, out of range ({bounds})")
        return value

    return check


def text(*, empty: bool = True) -> Check:
    """A string (never a number or a list of strings); with ``empty=False``, not ``""``."""

    def check(value: object, where: str) -> object:
        if type(value) is not str:
            raise MalformedError(f"'{where}' is {shown(value)}, not a string")
        if not empty and not value:
            raise MalformedError(f"'{where}' is empty")
        return value

    return check


def one_of(choices: Collection[str]) -> Check:
    """One of the strings ``choices``."""

    def check(value: object, where: str) -> object:
        if type(value) is not str or value not in choices:
            raise MalformedError(f"'{where}' is {shown(value)}, not one of {', '.join(choices)}")
        return value

    return check


def flag(value: object, where: str) -> object:
    """``true`` or ``false`` (never 0, 1 or a string)."""
    if type(value) is not bool:
        raise MalformedError(f"'{where}' is {shown(value)}, not true or false")
    return value


def seconds(value: object, where: str) -> object:
    """A time in seconds since 1970: a finite number, 0 or more (JSON may write it whole)."""
    if type(value) not in (int, float):
        raise MalformedError(f"'{where}' is {shown(value)}, not a number of seconds")
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number) or number < 0:
        raise MalformedError(f"'{where}' is {shown(value)}, not a time (finite, 0 or more)")
    return number


def optional(check: Check) -> Check:
    """``null``, or what ``check`` accepts."""
    return lambda value, where: None if value is None else check(value, where)


def tuple_of(check: Check) -> Check:
    """A JSON list, each item checked, as a tuple."""

    def convert(value: object, where: str) -> object:
        if type(value) is not list:
            raise MalformedError(f"'{where}' is {shown(value)}, not a list")
        return tuple(check(item, f"{where}[{index}]") for index, item in enumerate(value))

    return convert


def mapping_of(check: Check) -> Check:
    """A JSON object (its keys are strings), each value checked, as a dict."""

    def convert(value: object, where: str) -> object:
        if type(value) is not dict:
            raise MalformedError(f"'{where}' is {shown(value)}, not an object")
        return {key: check(item, f"{where}[{shown(key)}]") for key, item in value.items()}

    return convert


def record(
    cls: Callable[..., Any],
    table: Mapping[str, Check],
    *,
    defaults: bool = False,
    others: bool = False,
) -> Check:
    """A JSON object with ``table``'s keys, each checked, as a ``cls``.

    Every key must be there, unless ``defaults`` and ``cls`` (a dataclass) has a default for
    it: a record an older version wrote without a newer field. Keys outside the table are
    refused, unless ``others``: an event's details may carry more than its readers use.
    """
    optional_keys = _defaulted(cls) if defaults else frozenset()

    def convert(value: object, where: str) -> object:
        subject = f"'{where}'" if where else "it"
        if type(value) is not dict:
            raise MalformedError(f"{subject} is {shown(value)}, not an object")
        missing = sorted(table.keys() - value.keys() - optional_keys)
        if missing:
            raise MalformedError(f"{subject} lacks '{missing[0]}'")
        unknown = [] if others else sorted(value.keys() - table.keys())
        if unknown:
            raise MalformedError(f"{subject} has an unknown field {shown(unknown[0])}")
        prefix = f"{where}." if where else ""
        given = [name for name in table if name in value]
        return cls(**{name: table[name](value[name], prefix + name) for name in given})

    return convert


class JsonRecord(Generic[Decoded]):
    """A record read from JSON bytes: ``table``'s checks (``record``), and for a malformed one
    the reader's own error with one sentence. ``sentence`` has ``{subject}`` (where the bytes
    were read, quoted, else their first 40 bytes) and ``{why}`` (a field's ``MalformedError``,
    or JSON's own error), and says what to do."""

    def __init__(
        self,
        cls: type[Decoded],
        table: Mapping[str, Check],
        error: Callable[[str], Exception],
        sentence: str,
        *,
        defaults: bool = False,
    ) -> None:
        self._check = record(cls, table, defaults=defaults)
        self._error = error
        self._sentence = sentence

    def decode(self, data: bytes, where: str = "") -> Decoded:
        """The record in ``data`` (read from ``where``), each field of its type, or the error."""
        try:
            return cast(Decoded, self._check(json.loads(data), ""))
        except (ValueError, RecursionError) as error:  # MalformedError and JSON's errors
            subject = f"'{where}'" if where else repr(data[:40])
            raise self._error(self._sentence.format(subject=subject, why=error)) from error


def _defaulted(cls: Callable[..., Any]) -> frozenset[str]:
    """The fields of the dataclass ``cls`` that have a default (none of another class)."""
    if not is_dataclass(cls):
        return frozenset()
    return frozenset(
        field.name
        for field in fields(cls)
        if field.default is not MISSING or field.default_factory is not MISSING
    )
