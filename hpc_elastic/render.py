"""Turn a JobSpec into the sbatch script: one pure function, the only jinja2 import.

User values reach the template as data only. Everything that lands on a shell line is quoted
with ``shlex.quote`` here, before the template sees it; ``#SBATCH`` values were already checked
for spaces and newlines by the spec, and here get a backslash before each ``\\``, quote and
``#``, which sbatch's own reader would otherwise take as an escape, a quote or a comment; the
header's command line is escaped so no newline can end the comment. Each ``--setup`` line runs
through ``eval`` of its quoted text, so an unclosed quote, a trailing backslash or a
``cat <<EOF`` cannot reach past its own line into the launch. Templates are never built from
user values, so ``{{ ... }}`` inside a value stays text, and StrictUndefined turns a misspelt
variable into an error instead of a blank.
Templates render in Jinja's ``SandboxedEnvironment``: a template reached through a config file
may not be the user's own, and the sandbox keeps it from reaching Python (``__class__``,
``__subclasses__``, ``os``); the worst it can do is write a bad script, which is printed by
``render`` before anything runs. The sandbox needs jinja2 3.1.6 or later: 3.1.5's is escaped
with ``|attr("format")`` alone (CVE-2025-27516), so pyproject.toml asks for 3.1.6.
What may be rendered at all is checked first: the user's template, and every file it extends
or includes from beside it, must pass the config file's own rule (the user's, writable by no
one else: ``trust.unsafe_file_reason``), and built-in names always mean the built-in templates.
"""

from __future__ import annotations

import importlib.resources
import logging
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_elastic.errors import TemplateError, UsageError, one_line
from hpc_elastic.invocation import AgentInvocation
from hpc_elastic.jobdir import JobDir
from hpc_elastic.options import agent_options, job_environment, sbatch_options
from hpc_elastic.spec import ArrayPart, JobSpec, mounts_of
from hpc_elastic.trust import unsafe_file_reason

if TYPE_CHECKING:
    import jinja2

ELASTIC_TEMPLATE = "elastic.sh.j2"
FIXED_TEMPLATE = "fixed.sh.j2"
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RenderContext:
    """What the script records besides the spec; made by the caller, so render stays pure."""

    version: str
    command_line: tuple[str, ...]
    python: str
    run_id: str
    job_dir: Path

    def __post_init__(self) -> None:
        if not _RUN_ID.match(self.run_id):
            raise UsageError(
                f"Run id '{self.run_id}' is not usable; use letters, digits, '.', '_' and '-'."
            )
        if any(
            char.isspace() or not char.isprintable() or char == "\\" for char in str(self.job_dir)
        ):
            raise UsageError(
                f"Job directory {str(self.job_dir)!r} contains spaces, backslashes or control "
                "characters, which sbatch cannot take in --output; choose a --log-dir without them."
            )


@dataclass(frozen=True)
class SbatchScript:
    """A rendered script and the template it came from (a built-in name or a user's path)."""

    text: str
    template: str


def render(spec: JobSpec, context: RenderContext, part: ArrayPart | None = None) -> SbatchScript:
    """Render the job's sbatch script (``part``: which of its arrays; default the first, the
    only one unless the job grows elsewhere); no clock, no randomness, no Slurm, same input
    same text."""
    part = spec.array_parts()[0] if part is None else part
    variables = template_variables(spec.for_part(part), context, part)
    if spec.template is None:
        name = ELASTIC_TEMPLATE if spec.is_array else FIXED_TEMPLATE
        return SbatchScript(_render_builtin(name, variables), name)
    return SbatchScript(_render_user(spec.template, variables), str(spec.template))


def render_growth(spec: JobSpec, context: RenderContext) -> SbatchScript | None:
    """The script of the growth slots' array (``--grow-partition``/``--grow-qos``), or None:
    every slot is in the one array ``render`` gives."""
    parts = spec.array_parts()
    return render(spec, context, parts[1]) if len(parts) > 1 else None


def template_variables(
    spec: JobSpec, context: RenderContext, part: ArrayPart | None = None
) -> dict[str, object]:
    """The variables every template gets; docs/submit.md lists them for template authors."""
    part = spec.array_parts()[0] if part is None else part
    quote = shlex.quote
    python = quote(agent_python(spec, context))
    pyxis = spec.container == "pyxis"
    return {
        "version": context.version,
        "command_line": one_line(shlex.join(context.command_line)),
        "run_id": context.run_id,
        "job_name": spec.job_name,
        "job_dir": quote(str(context.job_dir)),
        "output_dir": sbatch_escape(str(context.job_dir).replace("%", "%%")),
        "elastic": spec.is_array,
        "nodes_min": spec.nodes.min,
        "nodes_max": spec.nodes.max,
        "spares": spec.spares,
        "array_size": spec.array_size,
        "array_range": part.range,
        "array_part": part.name,
        "nproc_per_node": spec.nproc_per_node,
        "sbatch": _sbatch_options(spec),
        "setup": [f"eval {quote(line)}" for line in spec.setup],
        "env": [
            f"{key}={quote(value)}" for key, value in (*job_environment(spec.values()), *spec.env)
        ],
        "python": python,
        "agent_flags": agent_invocation(spec, context).shell(),
        "worker": agent_invocation(spec, context).shell_worker(),
        "container_image": quote(spec.container_image or "") if pyxis else "",
        "container_mounts": quote(",".join(container_mounts(spec, context.job_dir)))
        if pyxis
        else "",
    }


def builtin_template_dir() -> Path:
    """Templates ship inside the wheel; an editable install finds them at the repo's top."""
    packaged = importlib.resources.files("hpc_elastic") / "templates"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parent.parent / "templates"


def sbatch_escape(text: str) -> str:
    """``text`` escaped so that sbatch's ``#SBATCH`` reader gives it back verbatim: that reader
    drops a backslash and keeps the next character, drops quotes, and ends the line at an
    unquoted ``#`` (``_get_argument`` in Slurm's ``src/sbatch/opt.c``)."""
    return re.sub(r"""([\\"'#])""", r"\\\1", text)


def _sbatch_options(spec: JobSpec) -> list[str]:
    return [sbatch_escape(option) for option in sbatch_options(spec.values())]


def agent_invocation(spec: JobSpec, context: RenderContext) -> AgentInvocation:
    """The agent each Slurm step runs; the template adds ``--slot``, which only the shell knows."""
    values = spec.values()
    if spec.container == "apptainer":
        # Standby workers would be host Pythons with torch imported, outside the image; the
        # agent would refuse the 'apptainer exec' command anyway and say so in every log.
        values["prewarm"] = False
    return AgentInvocation(
        python=agent_python(spec, context),
        run_id=context.run_id,
        job_dir=context.job_dir,
        nodes=_agent_range(spec),
        nproc_per_node=spec.nproc_per_node,
        zk=spec.zk,
        worker=worker_command(spec, context),
        auth_file=JobDir(context.job_dir).secret,
        options=agent_options(values),
    )


# --- containers (issue 14): where the agent runs, and what the workers run in --------------


def agent_python(spec: JobSpec, context: RenderContext) -> str:
    """The agent runs where the user's Python is. With pyxis the whole srun step is inside the
    image, so that is the image's Python; otherwise (Apptainer too) it is ``--python``'s."""
    return spec.container_python if spec.container == "pyxis" else context.python


def worker_command(spec: JobSpec, context: RenderContext) -> tuple[str, ...]:
    """What the agent starts for each local rank: the script under the image's Python inside
    a container, else under the agent's own Python. Apptainer wraps each worker in
    ``apptainer exec --nv`` (GPUs visible) with the job's directories bound; the environment
    the agent sets for the worker (rank, master address) passes through, as Apptainer keeps
    the caller's environment by default."""
    script = ("-u", str(spec.script), *spec.script_args)
    if spec.container == "apptainer":
        assert spec.apptainer is not None
        binds = ",".join(container_mounts(spec, context.job_dir))
        return ("apptainer", "exec", "--nv", "--bind", binds, spec.apptainer,
                spec.container_python, *script)  # fmt: skip
    if spec.container == "pyxis":
        return (spec.container_python, *script)
    return (context.python, *script)


def container_mounts(spec: JobSpec, job_dir: Path) -> tuple[str, ...]:
    """``SRC:DST[:FLAGS]`` for every mount, in the one form pyxis and Apptainer both read: the
    job directory (logs, checkpoints, events) and the script's directory at the same paths,
    then the user's ``--container-mounts``. A default directory inside another is not
    mounted twice (the script inside the job directory's copy of the code, say)."""
    defaults = outermost([job_dir, spec.script.parent])
    return (*(f"{path}:{path}" for path in defaults), *mounts_of(spec.container_mounts))


def outermost(paths: list[Path]) -> list[Path]:
    """``paths`` without repeats and without any that lies inside another, in order."""
    kept: list[Path] = []
    for path in paths:
        if not any(path == other or path.is_relative_to(other) for other in kept):
            kept = [other for other in kept if not other.is_relative_to(path)]
            kept.append(path)
    return kept


def _agent_range(spec: JobSpec) -> str:
    """A fixed job of N nodes trains on with fewer when one is lost, so its agents take 1:N.
    With hot spares it is an array, whose tasks Slurm starts one by one: N:N, so that it
    starts at N nodes, and a lost node is replaced by a spare (or the slot's requeue)."""
    nodes = spec.nodes
    return f"{nodes.min}:{nodes.max}" if spec.is_array else f"1:{nodes.max}"


def _environment(user_dir: Path | None) -> jinja2.Environment:
    import jinja2  # noqa: PLC0415 (here, so `hpc-elastic --help` does not pay for it)
    import jinja2.sandbox  # noqa: PLC0415

    return jinja2.sandbox.SandboxedEnvironment(
        loader=jinja2.FunctionLoader(lambda name: _find_template(name, user_dir)),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def _find_template(name: str, user_dir: Path | None) -> tuple[str, str, Callable[[], bool]]:
    """What ``{% extends %}`` and ``{% include %}`` reach: a built-in template first, whatever
    lies beside the user's, so a ``base.sh.j2`` planted next to it is never the one used;
    then a file beside the user's template, which must pass ``read_trusted_template``. The
    built-in ones are the package's own files: whoever can change them can change its code.
    A name with ``..`` never leaves its directory."""
    from jinja2 import TemplateNotFound  # noqa: PLC0415 (see _environment)
    from jinja2.loaders import split_template_path  # noqa: PLC0415

    pieces = split_template_path(name)
    builtin = builtin_template_dir().joinpath(*pieces)
    if builtin.is_file():
        return builtin.read_text(encoding="utf-8"), str(builtin), lambda: True
    if user_dir is not None and user_dir.joinpath(*pieces).is_file():
        path = user_dir.joinpath(*pieces)
        _log.debug("template %r is %s, beside the user's", name, path)
        return read_trusted_template(path), str(path), lambda: True
    where = "among the built-in templates" + (" or beside yours" if user_dir else "")
    raise TemplateNotFound(name, f"{name!r} not found {where}")


def read_trusted_template(path: Path) -> str:
    """The text of a template of the user's, refused unless it passes the config file's own
    rule (``trust.unsafe_file_reason``): the user's file, that no one else may write. The
    check is made on the open file, so the file checked is the file read."""
    with path.open("rb") as file:
        info = os.fstat(file.fileno())
        reason = unsafe_file_reason(info.st_uid, info.st_mode, os.geteuid())
        if reason is not None:
            raise TemplateError(
                f"Template '{path}' is not trusted because {reason}; remove it, or make it "
                "yours and writable only by you (chmod go-w)."
            )
        return file.read().decode("utf-8")


def _render_builtin(name: str, variables: dict[str, object]) -> str:
    return _environment(None).get_template(name).render(variables)


def _render_user(path: Path, variables: dict[str, object]) -> str:
    """A user's template may ``{% extends "elastic.sh.j2" %}`` and override its blocks."""
    import jinja2  # noqa: PLC0415 (see _environment)
    import jinja2.sandbox  # noqa: PLC0415

    try:
        source = read_trusted_template(path)
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise TemplateError(
            f"--template '{path}' cannot be read ({reason}); give the path of a Jinja2 "
            "sbatch template."
        ) from err
    environment = _environment(path.resolve().parent)
    try:
        return environment.from_string(source).render(variables)
    except jinja2.TemplateSyntaxError as err:
        raise TemplateError(
            f"--template '{path}' has a syntax error at line {err.lineno}: {err.message}; "
            "fix the template."
        ) from err
    except jinja2.exceptions.SecurityError as err:
        raise TemplateError(
            f"--template '{path}' tried something the template sandbox forbids ({err}); "
            "use only the documented variables and filters."
        ) from err
    except jinja2.TemplateError as err:
        raise TemplateError(
            f"--template '{path}' failed to render: {err.message}; fix the template "
            "(docs/submit.md lists the variables it may use)."
        ) from err
    except (OSError, UnicodeDecodeError) as err:
        raise TemplateError(
            f"--template '{path}' reaches a template that cannot be read ({err}); fix the "
            "template or the file it names."
        ) from err
