"""Secrets given to ``submit``: files that hold them, and a warning for those typed as flags.

A command line is public: while ``submit`` runs, every user of the login node reads it with
``ps``, and the script's own arguments are on the workers' command lines on every node for the
whole job. So a token should never be a flag's value. ``--env-file`` takes ``KEY=VALUE`` lines
from a file and ``--notify-file`` the webhook's URL; the URL may also come from the environment
(``HPC_ELASTIC_NOTIFY_URL``), which only its owner can read. A file that holds secrets is
checked like the config file (``trust.unsafe_file_reason``: ours, writable by nobody else) and
also readable by nobody else, since its whole point is to keep others from reading it.

A value typed on the command line that looks like a token (a known prefix such as ``ghp_``,
a variable named like a secret, a URL with credentials or a long random part) gets one
``warning:`` line that says where to put it instead; the job still goes ahead. The rules are
pure functions of the text (``token_reason``); the value itself is never printed, only its
first characters.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import re
import stat
import urllib.parse
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_elastic import contract, trust
from hpc_elastic.errors import UsageError, one_line
from hpc_elastic.options import parse_notify_url
from hpc_elastic.spec import parse_env

_log = logging.getLogger(__name__)

MAX_SECRET_FILE_BYTES = 1_000_000
"""An env file or a URL file is a few lines; anything bigger is the wrong file."""


# --- files that hold secrets -------------------------------------------------------------


def secret_file_reason(owner: int, mode: int, uid: int) -> str | None:
    """Why a file of secrets with this owner and mode must not be used by ``uid``, or None:
    the config file's rule (ours, nobody else may write it), and nobody else may read it."""
    reason = trust.unsafe_file_reason(owner, mode, uid)
    if reason is None and mode & (stat.S_IRGRP | stat.S_IROTH):
        reason = f"group or others may read it (mode {stat.S_IMODE(mode):04o})"
    return reason


def read_secret_text(path: Path, option: str) -> str:
    """The text of ``path``, a regular file that ``secret_file_reason`` accepts.

    Checked on the open descriptor, so the file judged is the file read (a link is followed:
    its target must pass). ``O_NONBLOCK``: a FIFO in its place fails the check instead of
    blocking the open."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise UsageError(
            f"{option} '{one_line(str(path))}' cannot be read ({error.strerror}); give a file "
            "of yours, mode 0600."
        ) from error
    # fstat before fdopen: Python refuses to wrap a directory's descriptor (and '' is '.').
    info = os.fstat(descriptor)
    reason = (
        "it is not a regular file"
        if not stat.S_ISREG(info.st_mode)
        else secret_file_reason(info.st_uid, info.st_mode, os.geteuid())
    )
    if reason is not None:
        os.close(descriptor)
        data = b""
    else:
        with os.fdopen(descriptor, "rb") as handle:
            data = handle.read(MAX_SECRET_FILE_BYTES + 1)
    if reason is not None:
        _log.debug("refusing %s %s: %s", option, path, reason)
        fix = (
            "give a file of yours, mode 0600"
            if not stat.S_ISREG(info.st_mode)
            else f"make it yours and private (chmod 600 '{one_line(str(path))}')"
        )
        raise UsageError(
            f"{option} '{one_line(str(path))}' is not trusted because {reason}; {fix}."
        )
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise UsageError(
            f"{option} '{one_line(str(path))}' is larger than {MAX_SECRET_FILE_BYTES} bytes; "
            "give the file of KEY=VALUE lines (or the URL) itself."
        )
    try:
        return data.decode()
    except UnicodeDecodeError as error:
        raise UsageError(
            f"{option} '{one_line(str(path))}' is not UTF-8 text (byte {error.start}); give a "
            "text file."
        ) from error


def parse_env_lines(text: str, path: Path) -> tuple[tuple[str, str], ...]:
    """``KEY=VALUE`` lines: blank lines and ``#`` comments are skipped, an ``export`` in front
    is allowed, one pair of matching quotes around a value is removed; the value is otherwise
    taken as it is (no escapes, no ``$`` expansion). Errors name the line, never its value."""
    pairs: list[tuple[str, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key, sep, value = stripped.removeprefix("export ").partition("=")
        try:
            parse_env(f"{key.strip()}=")  # the key alone: the value may be a secret
        except UsageError:
            sep = ""
        if not sep:
            raise UsageError(
                f"--env-file '{one_line(str(path))}' line {number} is not KEY=VALUE with KEY a "
                "shell variable name; write one variable a line, e.g. 'HF_TOKEN=hf_...'."
            )
        pairs.append((key.strip(), _unquoted(value)))
    return tuple(pairs)


def _unquoted(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def read_env_file(path: Path) -> tuple[tuple[str, str], ...]:
    """The variables ``--env-file`` gives the job."""
    return parse_env_lines(read_secret_text(path, "--env-file"), path)


def read_notify_file(path: Path) -> str:
    """The webhook ``--notify-file`` names: its first line that is not blank or a comment."""
    for line in read_secret_text(path, "--notify-file").splitlines():
        if line.strip() and not line.strip().startswith("#"):
            return parse_notify_url(line.strip())
    raise UsageError(
        f"--notify-file '{one_line(str(path))}' holds no URL; write the webhook's address on "
        "its first line."
    )


# --- values on the command line that look like tokens --------------------------------------

TOKEN_PREFIXES: dict[str, str] = {
    "ghp_": "GitHub",
    "gho_": "GitHub",
    "ghu_": "GitHub",
    "ghs_": "GitHub",
    "ghr_": "GitHub",
    "github_pat_": "GitHub",
    "glpat-": "GitLab",
    "hf_": "Hugging Face",
    "xoxb-": "Slack",
    "xoxp-": "Slack",
    "xoxa-": "Slack",
    "xoxs-": "Slack",
    "xapp-": "Slack",
    "AKIA": "AWS",
    "ASIA": "AWS",
    "sk-": "OpenAI and others'",
    "sk_live_": "Stripe",
    "rk_live_": "Stripe",
    "AIza": "Google",
    "npm_": "npm",
    "pypi-": "PyPI",
    "dapi": "Databricks",
}
"""Prefixes that providers put in front of their tokens, and whose tokens they are."""

_PREFIXED = re.compile(
    r"(?<![A-Za-z0-9])("
    + "|".join(re.escape(prefix) for prefix in sorted(TOKEN_PREFIXES, key=len, reverse=True))
    + r")([A-Za-z0-9_\-]{16,})"
)
"""A prefix at the start of a word, then at least 16 token characters (``sk-learn`` is none),
among which a digit or a capital (``hf_hub_download_file`` is a name, not a token)."""

SECRET_NAME_WORDS = frozenset(
    {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "PWD", "APIKEY", "CREDENTIAL", "CREDENTIALS", "AUTH"}
)
"""A variable or flag name holding one of these words (``HF_TOKEN``, ``--db-password``)
names a secret; so does ``API``, ``ACCESS``, ``PRIVATE`` or ``SIGNING`` followed by ``KEY``."""
_KEY_QUALIFIERS = frozenset({"API", "ACCESS", "PRIVATE", "SIGNING", "SECRET"})
SECRET_QUERY_WORDS = SECRET_NAME_WORDS | {"KEY", "SIG", "SIGNATURE", "CODE", "X-AMZ-SIGNATURE"}
"""A URL query parameter named with one of these words carries a credential."""

_WORD = re.compile(r"[A-Za-z0-9+=_\-]{20,}")
"""A run of base64/base62 characters long enough to be a token; ``/`` and ``.`` end it, so
paths and model names (``org/Model-7B-v0.1``) split into their parts."""
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://\S+")
_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)


def names_a_secret(name: str) -> bool:
    """Whether a variable or flag name says its value is a secret (``WANDB_API_KEY``)."""
    words = [word for word in re.split(r"[_\-]+", name.upper().lstrip("-")) if word]
    if SECRET_NAME_WORDS.intersection(words):
        return True
    return any(a in _KEY_QUALIFIERS and b == "KEY" for a, b in itertools.pairwise(words))


def _entropy(word: str) -> float:
    counts = Counter(word)
    return -sum(n / len(word) * math.log2(n / len(word)) for n in counts.values())


def _kind(char: str) -> str:
    return "lower" if char.islower() else "upper" if char.isupper() else "digit"


def looks_random(word: str) -> bool:
    """Whether ``word`` looks like random base62/base64 (a token), not a name or an id.

    Random text of that alphabet mixes lower case, upper case and digits, switches between
    them at most characters, and spreads over many symbols (Shannon entropy near log2 of its
    length). Names, even ``ResNet50_ImageNet_v2``, run in words; hex digests (git commits,
    run ids) lack upper case and are left alone: a hex secret is caught by its name instead.
    """
    if len(word) < 20 or not all(
        any(_kind(char) == kind for char in word if char.isalnum())
        for kind in ("lower", "upper", "digit")
    ):
        return False
    if sum(char in "_-" for char in word) > 2 + len(word) // 16:
        return False
    pairs = [(a, b) for a, b in itertools.pairwise(word) if a.isalnum() and b.isalnum()]
    switches = sum(_kind(a) != _kind(b) for a, b in pairs) / max(1, len(pairs))
    return switches >= 0.4 and _entropy(word) >= min(4.0, 0.9 * math.log2(len(word)))


def token_reason(value: str, name: str | None = None) -> str | None:
    """Why ``value`` (given for ``name``, a flag or variable name, when known) looks like a
    secret, as a phrase; None when it does not. ``KEY=VALUE`` is judged with ``KEY`` as name."""
    assignment = _ASSIGNMENT.match(value)
    if assignment is not None:
        name, value = assignment.group(1), assignment.group(2)
    for prefixed in _PREFIXED.finditer(value):
        prefix, rest = prefixed.group(1), prefixed.group(2)
        if any(char.isdigit() or char.isupper() for char in rest):  # not hf_hub_download
            return f"it starts with '{prefix}', as {TOKEN_PREFIXES[prefix]} tokens do"
    reason = _url_reason(value)
    if reason is not None:
        return reason
    if name is not None and names_a_secret(name) and _is_literal(value):
        return f"its name '{one_line(name)}' says it is a secret"
    if any(looks_random(word) for word in _WORD.findall(value)):
        return "it holds a long random string, as tokens are"
    return None


def _is_literal(value: str) -> bool:
    """A value itself, not a reference to one: a path (``/run/secrets/x``), a ``$VARIABLE``
    left for the job's shell, or nothing at all."""
    return bool(value) and not value.startswith(("/", "~", ".", "$"))


def _url_reason(value: str) -> str | None:
    """The first reason any URL in ``value`` gives: a password, a credential in its query, or
    a random part (a webhook's path is often its token)."""
    for url in _URL.findall(value):
        try:
            parts = urllib.parse.urlsplit(url)
            password = parts.password
        except ValueError:
            continue
        if password:
            return "the URL holds a password"
        for key, item in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
            words = re.split(r"[_\-]+", key.upper())
            if item and (names_a_secret(key) or SECRET_QUERY_WORDS.intersection(words)):
                return f"the URL's query holds '{one_line(key)}'"
        if any(looks_random(word) for word in _WORD.findall(f"{parts.path} {parts.query}")):
            return "the URL holds a long random part, as a webhook's token is"
    return None


@dataclass(frozen=True)
class Finding:
    """A command-line value that looks like a secret."""

    where: str
    """The flag it was given for (``--env``), or ``the script's arguments``."""
    shown: str
    """The value cut to its first characters, so the warning does not repeat the secret."""
    reason: str


SCRIPT_ARGUMENTS = "the script's arguments"


def shown(value: str) -> str:
    """``value`` cut to a hint: ``KEY=abc…``, a URL's scheme and host, or the first four
    characters and an ellipsis."""
    assignment = _ASSIGNMENT.match(value)
    if assignment is not None:
        return f"{assignment.group(1)}={shown(assignment.group(2))}"
    if _URL.fullmatch(value):
        scheme, _, rest = value.partition("://")
        host = rest.split("/", 1)[0].rpartition("@")[2]  # never the user and password
        return one_line(f"{scheme}://{host}/…")
    return one_line(value[:4]) + ("…" if len(value) > 4 else "")


def command_line_findings(argv: Sequence[str], value_flags: Iterable[str]) -> list[Finding]:
    """Each word of ``argv`` (a ``submit`` command line: options, SCRIPT, ``--``, the script's
    arguments) that ``token_reason`` finds secret, with the flag it belongs to.

    ``value_flags`` are the options that take a value (the option table's), so that in
    ``--env K=V`` the value is known to be ``--env``'s; after ``--``, a ``--name value`` or
    ``--name=value`` of the script is judged with its name too."""
    takes_value = frozenset(value_flags)
    findings: list[Finding] = []
    script_part = False
    flag: str | None = None
    for word in argv:
        if not script_part and word == "--":
            script_part, flag = True, None
            continue
        name, value = flag, word
        if word.startswith("--"):
            option, has_value, rest = word.partition("=")
            if not has_value:
                flag = option if (script_part or option in takes_value) else None
                continue
            name, value = option, rest
        flag = None
        reason = token_reason(value, name if script_part else None)
        if reason is not None:
            where = SCRIPT_ARGUMENTS if script_part else (name or "the command line")
            findings.append(Finding(where, shown(value), reason))
    return findings


def advice(finding: Finding) -> str:
    """Where the value should go instead, for the warning's last clause."""
    if finding.where == "--env":
        return "put it in a file of KEY=VALUE lines (mode 0600) and give --env-file FILE instead"
    if finding.where == "--notify":
        return (
            "give the URL in a file with --notify-file FILE (mode 0600), or in the variable "
            f"{contract.NOTIFY_URL_ENV}, instead"
        )
    if finding.where == SCRIPT_ARGUMENTS:
        return (
            "the workers' command lines show it on every node for the whole job too; give it "
            "with --env-file and let the script read it from its environment"
        )
    return "pass it in a file instead"


def warning(finding: Finding, command: str) -> str:
    """One sentence for one finding (the CLI prints it after ``warning: ``)."""
    return (
        f"The value '{finding.shown}' of {finding.where} looks like a secret ({finding.reason}), "
        f"and every user of this machine can read it with `ps` while `{command}` runs; "
        f"{advice(finding)}."
    )
