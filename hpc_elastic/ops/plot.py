"""``hpc-elastic events --plot``: world size and training step over time, as a PNG.

matplotlib is imported here only, and only when a plot is asked for (the ``plot`` extra).
The step curve is drawn from committed checkpoints, the one progress record every run leaves.
"""

from __future__ import annotations

from pathlib import Path

from hpc_elastic.errors import UsageError
from hpc_elastic.events import Event

_MARKS = {
    "preempt": ("preemption", "tab:red", "-"),
    "failure": ("worker failure", "tab:orange", "-"),
    "requeue": ("requeue", "tab:purple", "-"),
    "churn": ("node killed (churn)", "tab:gray", ":"),
}


def plot(history: list[Event], output: Path, title: str) -> None:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        from matplotlib.ticker import MaxNLocator  # noqa: PLC0415
    except ImportError as error:
        raise UsageError(
            "--plot needs matplotlib; install it with `pip install 'hpc-elastic[plot]'`."
        ) from error
    if not history:
        raise UsageError(f"The job '{title}' has no events yet; nothing to plot.")
    start = history[0].time
    rounds: dict[int, tuple[float, int]] = {}
    steps: list[tuple[float, int]] = []
    for event in history:
        if event.kind == "round" and event.round is not None and event.round not in rounds:
            rounds[event.round] = (event.time - start, int(event.details.get("world_size", 0)))
        elif event.kind == "checkpoint" and isinstance(event.details.get("step"), int):
            steps.append((event.time - start, event.details["step"]))
    end = history[-1].time - start

    figure, world_axis = plt.subplots(figsize=(8, 3.6), dpi=100)
    if rounds:
        times, sizes = zip(*sorted(rounds.values()), strict=True)
        world_axis.step([*times, end], [*sizes, sizes[-1]], where="post", color="tab:blue")
    world_axis.set_xlabel("seconds since the first event")
    world_axis.set_ylabel("world size", color="tab:blue")
    world_axis.set_ylim(bottom=0)
    world_axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    step_axis = world_axis.twinx()
    if steps:
        times, values = zip(*steps, strict=True)
        step_axis.plot(times, values, "o-", markersize=3, color="tab:green")
    step_axis.set_ylabel("training step (checkpoints)", color="tab:green")
    step_axis.set_ylim(bottom=0)
    labelled: set[str] = set()
    for event in history:
        if event.kind not in _MARKS or (
            event.kind == "churn" and event.details.get("action") != "kill"
        ):
            continue
        label, colour, style = _MARKS[event.kind]
        world_axis.axvline(
            event.time - start,
            color=colour,
            linestyle=style,
            linewidth=1,
            label=None if label in labelled else label,
        )
        labelled.add(label)
    if labelled:
        world_axis.legend(loc="lower right", fontsize="small")
    world_axis.set_title(title, fontsize="medium")
    figure.tight_layout()
    try:
        figure.savefig(output)
    except OSError as error:
        raise UsageError(
            f"--plot '{output}' cannot be written ({error.strerror}); give a writable path."
        ) from error
    finally:
        plt.close(figure)
