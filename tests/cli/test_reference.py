"""docs/reference.md cannot drift from the commands: it is what ``hpc_elastic.reference`` writes
today, it has a section for every command that ``--help`` lists, and each section lists exactly
the options that command's ``--help`` shows (read from ``--help``'s own output, not from the
generator)."""

from __future__ import annotations

import difflib
import re

from click.testing import CliRunner

from hpc_elastic import cli, reference

runner = CliRunner()


def help_of(path: tuple[str, ...]) -> str:
    """What ``hpc-elastic PATH --help`` prints."""
    result = runner.invoke(cli.app, [*path, "--help"])
    assert result.exit_code == 0, f"hpc-elastic {' '.join(path)} --help: {result.output}"
    return result.stdout


def help_section(text: str, title: str) -> list[str]:
    """The lines of one section of a ``--help`` ("Options", "Commands"), up to the next."""
    lines = text.splitlines()
    if f"{title}:" not in lines:
        return []
    body: list[str] = []
    for line in lines[lines.index(f"{title}:") + 1 :]:
        if line and not line.startswith(" "):
            break
        body.append(line)
    return body


def flags_in(declaration: str) -> set[str]:
    """``-f, --follow``, ``--requeue / --no-requeue``, ``--nodes N|MIN:MAX`` -> the flags."""
    return {word for word in re.split(r"[\s,/]+", declaration) if word.startswith("-")}


def options_in_help(text: str) -> set[str]:
    """The flags in the first column of ``--help``'s options (click indents it by two spaces;
    a wrapped description is indented further)."""
    flags: set[str] = set()
    for line in help_section(text, "Options"):
        if re.match(r" {2}-", line):
            flags |= flags_in(re.split(r"\s{2,}", line.strip())[0])
    return flags


def commands_in_help(text: str) -> list[str]:
    return [line.split()[0] for line in help_section(text, "Commands") if re.match(r" {2}\S", line)]


def every_command() -> list[tuple[str, ...]]:
    """Every command path that ``--help`` lists, the root first, as a user would find them."""
    found: list[tuple[str, ...]] = []
    waiting: list[tuple[str, ...]] = [()]
    while waiting:
        path = waiting.pop(0)
        found.append(path)
        waiting += [(*path, name) for name in commands_in_help(help_of(path))]
    return found


def reference_sections() -> dict[str, set[str]]:
    """docs/reference.md's sections (``## `hpc-elastic zk start```) -> the flags of the rows of
    their option table (``| `--nodes N\\|MIN:MAX` | ...``)."""
    sections: dict[str, set[str]] = {}
    current: set[str] | None = None
    in_options = False
    for line in reference.PAGE.read_text(encoding="utf-8").splitlines():
        heading = re.fullmatch(r"## `(hpc-elastic[^`]*)`", line)
        if heading:
            current = sections.setdefault(heading[1], set())
            in_options = False
        elif line.startswith("| Option |"):
            in_options = True
        elif not line.startswith("|"):
            in_options = False
        elif in_options and current is not None:
            row = re.match(r"\| `([^`]+)` \|", line)
            if row:
                current |= flags_in(row[1].replace("\\|", "|"))
    return sections


def test_docs_reference_md_is_what_the_generator_writes_from_the_commands_today() -> None:
    committed = reference.PAGE.read_text(encoding="utf-8")
    generated = reference.render()
    diff = "".join(
        difflib.unified_diff(
            committed.splitlines(keepends=True),
            generated.splitlines(keepends=True),
            "docs/reference.md",
            "generated",
            n=1,
        )
    )
    assert committed == generated, (
        f"docs/reference.md is out of date: run `{reference.FIX}` and commit it.\n{diff[:3000]}"
    )


def test_the_reference_has_a_section_for_every_command_that_help_lists_and_no_other() -> None:
    listed = {" ".join(("hpc-elastic", *path)) for path in every_command()}
    assert set(reference_sections()) == listed


def test_each_section_of_the_reference_lists_exactly_the_options_that_its_help_shows() -> None:
    sections = reference_sections()
    differences = []
    for path in every_command():
        name = " ".join(("hpc-elastic", *path))
        shown = options_in_help(help_of(path))
        documented = sections.get(name, set())
        assert shown, f"{name} --help lists no option: the help parser no longer reads it"
        if shown != documented:
            differences.append(
                f"{name}: only in --help {sorted(shown - documented)}, "
                f"only in the reference {sorted(documented - shown)}"
            )
    assert not differences, f"run `{reference.FIX}`: " + "; ".join(differences)
