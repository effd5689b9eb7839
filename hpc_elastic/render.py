"""Turn a JobSpec into the sbatch script: one pure function, the only jinja2 import.

User values reach the template as data only. Everything that lands on a shell line is quoted
with ``shlex.quote`` here, before the template sees it; ``#SBATCH`` values were already checked
for spaces and newlines by the spec; the header's command line is escaped so no newline can
end the comment. Templates are never built from user values, so ``{{ ... }}`` inside a value
stays text, and StrictUndefined turns a misspelt variable into an error instead of a blank.
"""

from __future__ import annotations

import importlib.resources
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_elastic.errors import TemplateError, UsageError, one_line
from hpc_elastic.spec import JobSpec, NodeRange

if TYPE_CHECKING:
    import jinja2

ELASTIC_TEMPLATE = "elastic.sh.j2"
FIXED_TEMPLATE = "fixed.sh.j2"
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


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
        if any(char.isspace() or not char.isprintable() for char in str(self.job_dir)):
            raise UsageError(
                f"Job directory {str(self.job_dir)!r} contains spaces or control characters, "
                "which sbatch cannot take in --output; choose a --log-dir without them."
            )


@dataclass(frozen=True)
class SbatchScript:
    """A rendered script and the template it came from (a built-in name or a user's path)."""

    text: str
    template: str


def render(spec: JobSpec, context: RenderContext) -> SbatchScript:
    """Render the job's sbatch script; no clock, no randomness, no Slurm, same input same text."""
    if spec.template is None:
        name = ELASTIC_TEMPLATE if spec.nodes.is_elastic else FIXED_TEMPLATE
        return SbatchScript(_render_builtin(name, template_variables(spec, context)), name)
    return SbatchScript(
        _render_user(spec.template, template_variables(spec, context)), str(spec.template)
    )


def template_variables(spec: JobSpec, context: RenderContext) -> dict[str, object]:
    """The variables every template gets; docs/submit.md lists them for template authors."""
    quote = shlex.quote
    python = quote(context.python)
    return {
        "version": context.version,
        "command_line": one_line(shlex.join(context.command_line)),
        "run_id": context.run_id,
        "job_name": spec.job_name,
        "job_dir": quote(str(context.job_dir)),
        "output_dir": str(context.job_dir),
        "elastic": spec.nodes.is_elastic,
        "nodes_min": spec.nodes.min,
        "nodes_max": spec.nodes.max,
        "nproc_per_node": spec.nproc_per_node,
        "sbatch": _sbatch_options(spec),
        "setup": list(spec.setup),
        "env": [f"{key}={quote(value)}" for key, value in spec.env],
        "python": python,
        "agent_flags": _agent_flags(spec, context),
        "worker": shlex.join([context.python, "-u", str(spec.script), *spec.script_args]),
    }


def builtin_template_dir() -> Path:
    """Templates ship inside the wheel; an editable install finds them at the repo's top."""
    packaged = importlib.resources.files("hpc_elastic") / "templates"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parent.parent / "templates"


def _sbatch_options(spec: JobSpec) -> list[str]:
    options = [f"{option}={value}" for option, value in spec.sbatch_values()]
    options.append("--requeue" if spec.requeue else "--no-requeue")
    options.append(f"--signal={spec.signal}")
    options.extend(spec.sbatch_args)
    return options


def _agent_flags(spec: JobSpec, context: RenderContext) -> list[str]:
    job_dir = str(context.job_dir)
    flags = [
        ("--run-id", context.run_id),
        ("--job-dir", job_dir),
        ("--nodes", _agent_range(spec.nodes)),
        ("--nproc-per-node", str(spec.nproc_per_node)),
        ("--zk", spec.zk),
        ("--zk-auth-file", f"{job_dir}/secret"),
        ("--max-restarts", str(spec.max_restarts)),
        ("--preempt-signal", spec.signal.name),
        ("--grace", str(spec.signal.seconds)),
        *((option, format(seconds, "g")) for option, seconds in spec.agent_timeouts()),
        *((option, str(count)) for option, count in spec.agent_counts()),
        *([("--prewarm", "torch")] if spec.prewarm else []),
    ]
    return [f"{flag} {shlex.quote(value)}" for flag, value in flags]


def _agent_range(nodes: NodeRange) -> str:
    """A fixed job of N nodes trains on with fewer when one is lost, so its agents take 1:N."""
    return f"{nodes.min}:{nodes.max}" if nodes.is_elastic else f"1:{nodes.max}"


def _environment(search_path: list[Path]) -> jinja2.Environment:
    import jinja2  # noqa: PLC0415 (here, so `hpc-elastic --help` does not pay for it)

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(path) for path in search_path]),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def _render_builtin(name: str, variables: dict[str, object]) -> str:
    return _environment([builtin_template_dir()]).get_template(name).render(variables)


def _render_user(path: Path, variables: dict[str, object]) -> str:
    """A user's template may ``{% extends "elastic.sh.j2" %}`` and override its blocks."""
    import jinja2  # noqa: PLC0415 (see _environment)

    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise TemplateError(
            f"--template '{path}' cannot be read ({reason}); give the path of a Jinja2 "
            "sbatch template."
        ) from err
    environment = _environment([path.resolve().parent, builtin_template_dir()])
    try:
        return environment.from_string(source).render(variables)
    except jinja2.TemplateSyntaxError as err:
        raise TemplateError(
            f"--template '{path}' has a syntax error at line {err.lineno}: {err.message}; "
            "fix the template."
        ) from err
    except jinja2.TemplateError as err:
        raise TemplateError(
            f"--template '{path}' failed to render: {err.message}; fix the template "
            "(docs/submit.md lists the variables it may use)."
        ) from err
