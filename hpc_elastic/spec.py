"""Specs: frozen dataclasses that validate themselves, so a bad value fails where it is parsed."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hpc_elastic.errors import UsageError

_NODES = re.compile(r"^\s*(\d+)\s*(?::\s*(\d+)\s*)?$")


@dataclass(frozen=True)
class NodeRange:
    """How many nodes the job may run on: ``4`` is fixed, ``1:4`` is elastic."""

    min: int
    max: int

    def __post_init__(self) -> None:
        if self.min < 1:
            raise UsageError(
                f"--nodes '{self}' asks for fewer than one node; give N or MIN:MAX with MIN >= 1."
            )
        if self.max < self.min:
            raise UsageError(
                f"--nodes '{self.min}:{self.max}' is inverted; give MIN:MAX with MIN <= MAX, "
                f"for example '{self.max}:{self.min}'."
            )

    @classmethod
    def parse(cls, text: str) -> NodeRange:
        match = _NODES.match(text)
        if match is None:
            raise UsageError(
                f"--nodes '{text}' is not a node count; give N (e.g. '4') or MIN:MAX (e.g. '1:4')."
            )
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        return cls(low, high)

    @property
    def is_elastic(self) -> bool:
        return self.min != self.max

    def __str__(self) -> str:
        return str(self.min) if self.min == self.max else f"{self.min}:{self.max}"
