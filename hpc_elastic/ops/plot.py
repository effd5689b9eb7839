"""``hpc-elastic events --plot``: world size and training step over time, as a PNG.

matplotlib is imported here only, and only when a plot is asked for (the ``plot`` extra).
The step curve is drawn from committed checkpoints, the one progress record every run leaves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_elastic.errors import UsageError
from hpc_elastic.events import CheckpointDetails, ChurnDetails, Event, Kind, RoundDetails

_MARKS: dict[str, tuple[str, str, str]] = {
    Kind.PREEMPT: ("preemption", "tab:red", "-"),
    Kind.FAILURE: ("worker failure", "tab:orange", "-"),
    Kind.REQUEUE: ("requeue", "tab:purple", "-"),
    Kind.CHURN: ("node killed (churn)", "tab:gray", ":"),
}


def _curves(
    history: list[Event], start: float
) -> tuple[dict[int, tuple[float, int]], list[tuple[float, int]]]:
    """(seconds, world size) at the first event of each round; (seconds, step) per checkpoint."""
    rounds: dict[int, tuple[float, int]] = {}
    steps: list[tuple[float, int]] = []
    for event in history:
        if event.kind == Kind.ROUND and event.round is not None and event.round not in rounds:
            world_size = RoundDetails.from_details(event.details).world_size
            rounds[event.round] = (event.time - start, world_size)
        elif event.kind == Kind.CHECKPOINT:
            step = CheckpointDetails.from_details(event.details).step
            if step is not None:
                steps.append((event.time - start, step))
    return rounds, steps


def _mark(axis: Any, history: list[Event], start: float) -> bool:
    """A vertical line per disruption (``_MARKS``), each kind labelled once; whether any."""
    labelled: set[str] = set()
    for event in history:
        if event.kind not in _MARKS or (
            event.kind == Kind.CHURN and ChurnDetails.from_details(event.details).action != "kill"
        ):
            continue
        label, colour, style = _MARKS[event.kind]
        axis.axvline(
            event.time - start,
            color=colour,
            linestyle=style,
            linewidth=1,
            label=None if label in labelled else label,
        )
        labelled.add(label)
    return bool(labelled)


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
    rounds, steps = _curves(history, start)
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
    if _mark(world_axis, history, start):
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
