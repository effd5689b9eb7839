"""docs/reference.md, generated: every command of ``hpc-elastic`` and every option it takes.

    python -m hpc_elastic.reference --write     # rewrite docs/reference.md
    python -m hpc_elastic.reference             # print the page

The page is read off the commands themselves: ``cli.app`` with every lazy command loaded, whose
options are the option table's rows (``options.SUBMIT_OPTIONS``, ``AGENT_OPTIONS``) made click
options. Each option's line is the help record that ``--help`` prints (click's
``get_help_record``: the flags, the metavar, the help and the default), so the page says what
``--help`` says; the config-file column comes from the table's ``config_key``.
``tests/cli/test_reference.py`` fails when the committed page differs from what this writes, and
when a command's ``--help`` lists other options than the page.

Nothing of the command line imports this module, so it costs ``hpc-elastic`` nothing.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import click

from hpc_elastic import cli, options

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"
"""Where ``--write`` puts the page: docs/ of the checkout this module lives in."""

FIX = "python -m hpc_elastic.reference --write"
"""The command that brings docs/reference.md up to date (the test's failure names it)."""

CONFIG_COMMANDS = frozenset({"hpc-elastic submit", "hpc-elastic render"})
"""The commands that read hpc-elastic.toml (``commands/submit.py``: ``load_config``); ``run``
and the agent take flags only, so their pages have no config-key column."""

INTRO = """\
# Command reference

Every command of `hpc-elastic` and every option it takes, as its `--help` prints them.
This page is generated from the commands and the option table (`hpc_elastic/options.py`):
do not edit it by hand, run `{fix}` instead.
The guides say when to use what: [submitting](submit.md), [local mode](local-mode.md),
[operating a job](operations.md), [your own ZooKeeper](cluster-setup.md), [the agent](agent.md).

For `submit` and `render`, the "Config key" column names the key that sets the option in
`hpc-elastic.toml` or under `[tool.hpc-elastic]` in `pyproject.toml`
([config file](submit.md#config-file)); a flag you type beats the file.
"""


def commands(
    command: click.Command, context: click.Context
) -> Iterator[tuple[click.Command, click.Context]]:
    """``command`` and every visible command below it, depth first, in ``--help``'s order.

    ``get_command`` on the root loads a lazy command (``cli._App``), as running it would."""
    yield command, context
    group = command if isinstance(command, click.Group) else None
    if group is None:
        return
    for name in group.list_commands(context):
        child = group.get_command(context, name)
        if child is None or child.hidden:
            continue
        yield from commands(child, context_of(child, name, context))


def context_of(
    command: click.Command, name: str, parent: click.Context | None = None
) -> click.Context:
    """The context click gives ``command`` when it runs: its own settings (``-h`` as well as
    ``--help``, from the root's) apply to its help records, and its parent's are inherited."""
    return click.Context(command, info_name=name, parent=parent, **command.context_settings)


def root() -> tuple[click.Command, click.Context]:
    """The ``hpc-elastic`` command group and its context, as the console script starts it."""
    return cli.app, context_of(cli.app, "hpc-elastic")


def anchor(path: str) -> str:
    """GitHub's anchor of a heading ``path`` in backticks: lower case, spaces as hyphens."""
    return re.sub(r"[^a-z0-9 _-]", "", path.lower()).replace(" ", "-")


def cell(text: str) -> str:
    """One table cell: one line, its pipes escaped (inside code spans too, as GitHub needs)."""
    return " ".join(text.split()).replace("|", "\\|")


def help_text(text: str | None) -> list[str]:
    """A command's help as Markdown: paragraphs joined as click rewraps them; a ``\\b``
    paragraph, which click prints as it is, becomes a code block (its title line above it)."""
    lines: list[str] = []
    body = inspect.cleandoc(text or "").partition("\f")[0]
    for paragraph in re.split(r"\n\s*\n", body):
        if not paragraph.strip():
            continue
        if paragraph.startswith("\b"):
            kept = paragraph.split("\n")[1:]
            if kept and kept[0].strip().endswith(":") and not kept[0].startswith(" "):
                lines += [kept.pop(0), ""]
            lines += ["```text", *inspect.cleandoc("\n".join(kept)).splitlines(), "```", ""]
        else:
            lines += [" ".join(paragraph.split()), ""]
    return lines


def parameter_rows(command: click.Command, context: click.Context) -> tuple[list[str], list[str]]:
    """The arguments' and the options' table rows, from the help records ``--help`` prints."""
    keys = {row.name: row.config_key for row in options.SUBMIT_OPTIONS}
    with_keys = context.command_path in CONFIG_COMMANDS
    arguments: list[str] = []
    flags: list[str] = []
    for parameter in command.get_params(context):
        record = parameter.get_help_record(context)
        if record is None:  # hidden
            continue
        declaration, text = record
        row = f"| `{cell(declaration)}` | {cell(text)} |"
        if parameter.param_type_name == "argument":
            arguments.append(row)
            continue
        if with_keys:
            key = keys.get(parameter.name or "")
            row += f" `{key}` |" if key else " |"
        flags.append(row)
    return arguments, flags


def subcommand_rows(command: click.Command, context: click.Context) -> list[str]:
    """A group's commands, each with the first sentence of its help and a link to its section."""
    if not isinstance(command, click.Group):
        return []
    rows = ["| Command | What it does |", "|---|---|"]
    for name in command.list_commands(context):
        child = command.get_command(context, name)
        if child is None or child.hidden:
            continue
        path = f"{context.command_path} {name}"
        summary = child.get_short_help_str(limit=1000)
        rows.append(f"| [`{name}`](#{anchor(path)}) | {cell(summary)} |")
    return [*rows, ""]


def section(command: click.Command, context: click.Context) -> list[str]:
    """One command's section: usage, help, subcommands, arguments, options."""
    path = context.command_path
    usage = " ".join([path, *command.collect_usage_pieces(context)])
    lines = [f"## `{path}`", "", "```text", usage, "```", "", *help_text(command.help)]
    lines += subcommand_rows(command, context)
    arguments, flags = parameter_rows(command, context)
    if arguments:
        lines += ["| Argument | Description |", "|---|---|", *arguments, ""]
    if flags:
        header = "| Option | Description |"
        rule = "|---|---|"
        if path in CONFIG_COMMANDS:
            header, rule = header + " Config key |", rule + "---|"
        lines += [header, rule, *flags, ""]
    return lines


def render() -> str:
    """The whole page."""
    lines = [INTRO.format(fix=FIX)]
    for command, context in commands(*root()):
        lines += section(command, context)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hpc_elastic.reference", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--write", action="store_true", help=f"write the page to {PAGE}")
    arguments = parser.parse_args(argv)
    page = render()
    if arguments.write:
        PAGE.write_text(page, encoding="utf-8")
        print(f"wrote {PAGE}")
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
