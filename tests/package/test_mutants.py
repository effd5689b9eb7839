"""The planted bugs of ``bench/mutants.toml`` stay current as the code they mutate changes.

``scripts/mutation-test`` refuses to run while a mutant's snippet is not in its file exactly
once; this test says so in the suite, at the commit that moved the code, not at the next
mutation run.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def mutation_test() -> ModuleType:
    """``bench/mutation_test.py``, which is a script, not a module of the package."""
    path = ROOT / "bench" / "mutation_test.py"
    spec = importlib.util.spec_from_file_location("mutation_test", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutation_test", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_planted_bug_finds_its_snippet_in_its_file_exactly_once() -> None:
    bench = mutation_test()
    assert bench.stale(bench.load()) == []
