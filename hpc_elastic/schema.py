"""An option is a dataclass field: its declaration is the option's schema.

``spec.JobSpec`` declares the options of ``submit``, ``render`` and the Python API, and
``options.AgentArguments`` those of ``hpc-elastic agent``, each on its own field, with one of
the builders here. The field gives the option's name (``nproc_per_node`` is the flag
``--nproc-per-node`` and the config key ``nproc-per-node``), its annotation the value's type
and its default the option's default (no default: a required option); the builder adds only
what a field cannot say: the help, how a flag's text (``parse``) and a config file's value
(``read``) become the value, how a value given in Python is checked (``check``), and where the
value goes besides the dataclass (``sbatch``, ``agent``, ``environment``). ``options_of(cls)``
reads the rows back as ``Option`` records, in field order, which is the order of ``--help``,
of the ``#SBATCH`` lines and of the agent flags. This is submitit's signature-as-schema: there,
the parameters of the function that writes the sbatch script are the valid options and their
defaults; here, a dataclass's fields are. Adding an option is a field, the code that uses it,
and its test.

A builder cannot know the name of the field it is assigned to, so it stores a function from
that name to the row's columns (``Columns``); ``options_of`` calls it with the field's name,
so that flags, parsers and error messages are spelt from the one name.

Nothing here imports click: ``options`` makes the rows click options.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from hpc_elastic.errors import UsageError

ConfigReader = Callable[[object, Path], object]
"""A config-file value and the file's directory -> the option's value; raises UsageError."""
AgentFlags = Sequence[tuple[str, ...]]
"""``("name", "value")`` or ``("name",)`` for each agent flag an option becomes, ``name`` the
agent's option (a field of ``options.AgentArguments``): ``options.agent_options`` spells its
flag from the agent's table, which the classes that declare these rows cannot import."""
Columns = Callable[[str], Mapping[str, Any]]
"""A field's name -> the columns of its ``Option`` besides name, type and default."""

OPTION = "hpc_elastic.option"
"""The key of a field's ``metadata`` that makes the field an option (its ``Columns``)."""

AGENT_DECIDES = "the agent decides"
"""``show_default`` of a ``submit`` option left unset so the agent's own default applies;
``options`` shows that default instead ("the agent's 600"), read from the agent's field."""


class WrongTypeError(UsageError):
    """A config value of the wrong TOML type; ``config`` adds which file and key."""


@dataclass(frozen=True)
class Option:
    """One option, read back from its field (``options_of``); see the module docstring."""

    name: str
    """The field's name: the click parameter, the ``JobSpec`` field, ``config.values``' key."""
    type: Any
    """The field's annotation (``tuple[str, ...]`` for a repeatable option)."""
    help: str
    default: object = None
    """The field's default: the value when neither a flag nor the config file gives one."""
    parse: Callable[[str], object] | None = None
    """A flag's text -> value (click's type: ``clicktools.Parsed``); None: click converts by
    ``type``."""
    item: Callable[[str], object] | None = None
    """For a repeatable option: each flag's text -> one item of the value's tuple."""
    read: ConfigReader | None = None
    check: Callable[[Any], object] | None = None
    """Raises the flag's UsageError for a value the dataclass was given that the flag would
    have refused (``JobSpec`` runs it on every value that is set: the Python API's way in)."""
    metavar: str | None = None
    flag: str | None = None
    """The flag's declaration when it is not ``--<name>``, e.g. ``--requeue/--no-requeue``."""
    show_default: bool | str = True
    """What ``--help`` says as the default; a string for defaults decided at run time."""
    combine: Callable[[object, object], object] | None = None
    """How a flag's value joins the config file's instead of replacing it (``--env``)."""
    sbatch: Callable[[Any], Sequence[str]] | None = None
    agent: Callable[[Any], AgentFlags] | None = None
    environment: Callable[[Any], Sequence[tuple[str, str]]] | None = None
    """Variables the job's script exports for the agents and workers, as (name, value)."""
    in_spec: bool = True
    """Whether ``JobSpec`` has this field (``--python`` only picks the interpreter)."""
    after: str | None = None
    """For an option of another class than ``JobSpec``: the option it follows in ``--help``."""
    required: bool = False
    """The field has no default: the command refuses to run without it (the agent's
    ``--run-id``); ``default`` unused."""
    envvar: str | None = None
    """A variable that gives the value when no flag does (``contract``'s name for it)."""

    @property
    def config_key(self) -> str | None:
        return self.name.replace("_", "-") if self.read is not None else None

    @property
    def cli_flag(self) -> str:
        return flag_of(self.name) if self.flag is None else self.flag

    @property
    def repeatable(self) -> bool:
        return self.item is not None or typing.get_origin(self.type) is tuple

    def finish(self, value: object) -> object:
        """A click value as the dataclass holds it: repeatable options become tuples of items."""
        if not self.repeatable:
            return value
        items = value if isinstance(value, list | tuple) else ()
        return tuple(self.item(text) if self.item else text for text in items)


def flag_of(name: str) -> str:
    """The flag of the field ``name``: ``nproc_per_node`` -> ``--nproc-per-node``."""
    return f"--{name.replace('_', '-')}"


# --- reading the rows back ------------------------------------------------------------------


def declare(columns: Columns, default: object = MISSING) -> Any:
    """A field that is an option; without ``default``, a required one. Typed ``Any`` so that
    ``nodes: NodeRange = text(...)`` type-checks, as ``dataclasses.field`` is."""
    if default is MISSING:
        return field(metadata={OPTION: columns})
    return field(default=default, metadata={OPTION: columns})


def options_of(cls: type) -> tuple[Option, ...]:
    """The options ``cls``'s fields declare, in field order; fields without one are left out."""
    hints = typing.get_type_hints(cls)
    return tuple(_row(item, hints[item.name]) for item in fields(cls) if OPTION in item.metadata)


def _row(declared: Field[Any], annotation: Any) -> Option:
    """The field as an option. A column ``decided_late`` says the command line leaves the value
    unset (None) for the plan to decide (``job_name``: the script's name): the option's type
    then admits None and its default is None, not the field's."""
    columns = dict(declared.metadata[OPTION](declared.name))
    required = declared.default is MISSING
    if columns.pop("decided_late", False):
        return Option(declared.name, annotation | None, **columns)
    return Option(
        declared.name,
        annotation,
        default=None if required else declared.default,
        required=required,
        **columns,
    )


def columns_of(cls: type, name: str) -> dict[str, Any]:
    """The columns ``cls``'s field ``name`` declares, for an option of another class that is
    the same option (``like``)."""
    declared = next(item for item in fields(cls) if item.name == name)
    return dict(declared.metadata[OPTION](name))


def like(cls: type, default: object = MISSING, **changes: Any) -> Any:
    """The option of ``cls`` with this field's name, as another command reads the flag it
    becomes: the same spelling, parser and help. Its columns that say where ``cls``'s value
    goes (config key, ``#SBATCH`` line, agent flags, exported variables) mean nothing there;
    a default that ``cls`` leaves to the agent (``AGENT_DECIDES``) is this field's own."""

    def columns(name: str) -> Mapping[str, Any]:
        source = columns_of(cls, name)
        if source.get("show_default") == AGENT_DECIDES:
            source["show_default"] = True
        blank = {"read": None, "sbatch": None, "agent": None, "environment": None}
        return {**source, **blank, **changes}

    return declare(columns, default)


# --- value parsers shared by flags, config files and checks ---------------------------------


def parse_positive(option: str, value: int, *, zero_ok: bool = False) -> int:
    """Counts like --nproc-per-node: ``count_parser`` or the config reader checks it is an int,
    this checks it makes sense."""
    if value < 0 or (value == 0 and not zero_ok):
        bound = "0 or more" if zero_ok else "1 or more"
        raise UsageError(f"{option} '{value}' is out of range; give {bound}.")
    return value


def count_parser(option: str, *, zero_ok: bool = False) -> Callable[[str], int]:
    """A flag's parser for counts, so '--nproc-per-node x' quotes 'x' like every other error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise UsageError(f"{option} '{text}' is not a whole number; give e.g. '4'.") from None
        return parse_positive(option, value, zero_ok=zero_ok)

    return parse


def seconds_parser(option: str) -> Callable[[str], float]:
    """A flag's parser for durations in seconds (fractions allowed)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise UsageError(
                f"{option} '{text}' is not a number of seconds; give e.g. '30'."
            ) from None
        if not value >= 0:
            raise UsageError(f"{option} '{text}' is negative; give 0 or more seconds.")
        return value

    return parse


def check_seconds(option: str, value: float) -> float:
    if value < 0:
        raise UsageError(f"{option} '{value}' is negative; give 0 or more seconds.")
    return value


# --- config-file readers -------------------------------------------------------------------


def _wrong_type(expected: str, value: object) -> WrongTypeError:
    return WrongTypeError(
        f"must be {expected}, not {type(value).__name__} {value!r}; fix the config file."
    )


def read_text(parse: Callable[[str], object], *, numbers: bool = False) -> ConfigReader:
    """A string value (or a bare number, for keys like ``nodes = 4`` and ``time = 60``)."""

    def convert(value: object, _base: Path) -> object:
        if numbers and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise _wrong_type("a string", value)
        return parse(value)

    return convert


def read_count(option: str, *, zero_ok: bool = False) -> ConfigReader:
    def convert(value: object, _base: Path) -> object:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _wrong_type("an integer", value)
        return parse_positive(option, value, zero_ok=zero_ok)

    return convert


def read_seconds(option: str) -> ConfigReader:
    def convert(value: object, _base: Path) -> object:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _wrong_type("a number of seconds", value)
        if value < 0:
            raise UsageError(f"{option} '{value}' is negative; give 0 or more seconds.")
        return float(value)

    return convert


def read_flag(value: object, _base: Path) -> object:
    if not isinstance(value, bool):
        raise _wrong_type("true or false", value)
    return value


def read_path(value: object, base: Path) -> object:
    """Relative paths in the file are relative to the file, not to the working directory."""
    if not isinstance(value, str):
        raise _wrong_type("a path string", value)
    return base / Path(value).expanduser()


def read_lines(parse: Callable[[str], str]) -> ConfigReader:
    def convert(value: object, _base: Path) -> object:
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise _wrong_type("a list of strings", value)
        return tuple(parse(item) for item in value)

    return convert


# --- where a value goes besides the dataclass -----------------------------------------------


def sbatch_line(template: str) -> Callable[[Any], Sequence[str]]:
    """The ``#SBATCH`` option for a value that is set (``template`` with ``{}`` for it)."""
    return lambda value: () if value is None else (template.format(value),)


def pass_on(name: str, text: Callable[[Any], str]) -> Callable[[Any], AgentFlags]:
    """The agent's option ``name`` with the value as ``text`` writes it, for a value that is set."""
    return lambda value: () if value is None else ((name, text(value)),)


def exported(name: str) -> Callable[[Any], tuple[tuple[str, str], ...]]:
    """The variable ``name`` for a value that is set."""
    return lambda value: () if value is None else ((name, str(value)),)


def exported_unless_default(
    name: str, default: object, text: Callable[[Any], str] = str
) -> Callable[[Any], tuple[tuple[str, str], ...]]:
    """Export ``name`` only for a value other than the training helpers' own default, so a job
    that sets nothing gets the same script as before (and a user's ``--env`` still applies)."""
    return lambda value: () if value is None or value == default else ((name, text(value)),)


# --- builders: one per kind of value --------------------------------------------------------


def option(help: str, default: object = MISSING, **columns: Any) -> Any:
    """An option click converts by the field's type (no parser of its own)."""
    return declare(lambda _name: {"help": help, **columns}, default)


def text(
    help: str,
    parse: Callable[[str], object],
    default: object = MISSING,
    *,
    numbers: bool = False,
    **columns: Any,
) -> Any:
    """A value written as text: the flag and the config file go through the same ``parse``
    (``numbers``: the file may also give a bare number, as in ``time = 60``); a text value
    given in Python does too (``check``; a value of another type was made by ``parse``)."""

    def check(value: object) -> object:
        return parse(value) if isinstance(value, str) else value

    return declare(
        lambda _name: {
            "help": help,
            "parse": parse,
            "read": read_text(parse, numbers=numbers),
            "check": check,
            **columns,
        },
        default,
    )


def count(
    help: str,
    default: int | None,
    *,
    metavar: str = "N",
    zero_ok: bool = False,
    agent: bool = False,
    **columns: Any,
) -> Any:
    """A whole number, 1 or more (``zero_ok``: 0 or more); ``agent``: passed on to the agent's
    option of the same name (``--<name> N``) when set."""

    def columns_for(name: str) -> Mapping[str, Any]:
        flag = flag_of(name)
        return {
            "help": help,
            "parse": count_parser(flag, zero_ok=zero_ok),
            "read": read_count(flag, zero_ok=zero_ok),
            "check": lambda value: parse_positive(flag, value, zero_ok=zero_ok),
            "metavar": metavar,
            "agent": pass_on(name, str) if agent else None,
            **columns,
        }

    return declare(columns_for, default)


def seconds(help: str, show_default: str, **columns: Any) -> Any:
    """An agent knob in seconds, passed on to the agent's option of the same name
    (``--<name> S``) when set; unset (the default), the agent's own default applies, which
    ``show_default`` names."""

    def columns_for(name: str) -> Mapping[str, Any]:
        flag = flag_of(name)
        return {
            "help": help,
            "parse": seconds_parser(flag),
            "read": read_seconds(flag),
            "check": lambda value: check_seconds(flag, value),
            "metavar": "S",
            "show_default": show_default,
            "agent": pass_on(name, lambda value: format(value, "g")),
            **columns,
        }

    return declare(columns_for, None)


def duration(help: str, default: float, **columns: Any) -> Any:
    """A number of seconds the command always has a value for (the agent's ``--grace``)."""

    def columns_for(name: str) -> Mapping[str, Any]:
        return {"help": help, "parse": seconds_parser(flag_of(name)), "metavar": "S", **columns}

    return declare(columns_for, default)


def switch(help: str, default: bool, **columns: Any) -> Any:
    """A ``--<name>/--no-<name>`` flag, ``true``/``false`` in the config file."""

    def columns_for(name: str) -> Mapping[str, Any]:
        flag = flag_of(name)
        negative = flag_of(f"no_{name}")
        return {"help": help, "read": read_flag, "flag": f"{flag}/{negative}", **columns}

    return declare(columns_for, default)


def path(help: str, default: object = None, **columns: Any) -> Any:
    """A path; in the config file, relative to the file's directory."""
    return option(help, default, read=read_path, **columns)


def lines(help: str, parse: Callable[[str], str], **columns: Any) -> Any:
    """A repeatable text option (a tuple of texts, ``()`` unset), each item through ``parse``:
    one per flag, a list in the config file."""

    def check(values: tuple[str, ...]) -> object:
        return [parse(value) for value in values]

    return option(help, (), read=read_lines(parse), check=check, **columns)
