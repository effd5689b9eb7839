"""What the fuzz tests of the typed decoders share (``hpc_elastic/decoding.py``): any JSON,
mutations of a valid encoding, and a judge of a decoded value by its class's own annotations,
never by the decoder's table (which is what is under test).

Every decoder's contract is the same: a value whose every field has its declared type, or one
error of the decoder's own class whose text is one line. ``decodes_or_refuses`` checks it.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields, is_dataclass
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from hypothesis import strategies as hs

json_values = hs.recursive(
    hs.none() | hs.booleans() | hs.integers(-(2**70), 2**70) | hs.floats() | hs.text(max_size=10),
    lambda children: (
        hs.lists(children, max_size=4) | hs.dictionaries(hs.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
"""Any JSON value, NaN and infinities included (``json.dumps`` writes them)."""

AWKWARD: tuple[object, ...] = (True, False, 0, -1, 7, 2.9, 2**70, math.nan, math.inf)
AWKWARD += ("7", "", "x", "a/b", None, [], ["x"], {}, {"a": 1})
"""The values a coercing decoder took for what they are not: a bool or a float as a count
(``int(True)``, ``int(2.9)``), digits as a number, NaN as a time, a list as a name."""
awkward_or_any = hs.one_of(hs.sampled_from(AWKWARD), json_values)


def well_typed(value: object, hint: Any) -> bool:
    """Whether ``value`` has the type ``hint`` names (the dataclasses' own annotations), so
    the fuzz tests judge a decoded value by the declarations, not by the decoder's table."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (UnionType, Union):
        return any(well_typed(value, arg) for arg in args)
    if origin is tuple:
        return isinstance(value, tuple) and all(well_typed(item, args[0]) for item in value)
    if origin in (dict, Mapping):
        return isinstance(value, dict) and all(
            well_typed(key, args[0]) and well_typed(item, args[1]) for key, item in value.items()
        )
    if hint is type(None):
        return value is None
    if hint in (int, float):
        return type(value) is hint
    if is_dataclass(hint):
        hints = get_type_hints(hint)
        return type(value) is hint and all(
            well_typed(getattr(value, field.name), hints[field.name]) for field in fields(hint)
        )
    return isinstance(value, hint)


def at(document: Any, path: list[str | int]) -> Any:
    for step in path:
        document = document[step]
    return document


def places(document: Any, path: list[str | int] | None = None) -> list[list[str | int]]:
    """Every key path into a JSON document, the document itself first."""
    path = path or []
    found = [path]
    if isinstance(document, dict):
        for key, item in document.items():
            found += places(item, [*path, key])
    elif isinstance(document, list):
        for index, item in enumerate(document):
            found += places(item, [*path, index])
    return found


def mutated(document: dict[str, Any], data: hs.DataObject) -> bytes:
    """``document`` (a valid encoding, parsed) with one value somewhere in it replaced by any
    JSON, removed, or one more added beside it; encoded again."""
    inner = places(document)[1:]
    if not inner:  # an empty record: only a field can be added
        document[data.draw(hs.text(max_size=10))] = data.draw(json_values)
        return json.dumps(document).encode()
    path = data.draw(hs.sampled_from(inner))
    parent = at(document, path[:-1])
    mutation = data.draw(hs.sampled_from(["replace", "replace", "delete", "add"]))
    if mutation == "replace":
        parent[path[-1]] = data.draw(awkward_or_any)
    elif mutation == "delete":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[data.draw(hs.text(max_size=10))] = data.draw(json_values)
    else:
        parent.append(data.draw(json_values))
    return json.dumps(document).encode()


def each_value_replaced(document: Any) -> Iterator[bytes]:
    """``document`` (a valid encoding, parsed) with each value in it, at any depth, replaced
    by each ``AWKWARD`` value in turn: every field meets every value that was once coerced,
    which random mutation only sometimes brings together."""
    for path in places(document)[1:]:
        for value in AWKWARD:
            mutant = copy.deepcopy(document)
            at(mutant, path[:-1])[path[-1]] = value
            yield json.dumps(mutant).encode()


def decodes_or_refuses(
    decode: Callable[[bytes], object],
    data: bytes,
    error: type[Exception],
    hint: Any,
    fields_of: Callable[[Any], Mapping[str, object]] | None = None,
) -> object | None:
    """The decoders' contract: ``decode(data)`` is a value of type ``hint`` in every field
    (returned), or raises one ``error`` whose text is one line (then None).

    With ``fields_of`` (the value's fields as its writer stores them), a decoded value must
    also hold what ``data`` holds, field for field: a decoder that coerces (``str(["x"])``
    as a host) makes a value of the right type that is not what was written."""
    try:
        value = decode(data)
    except error as refused:
        message = str(refused)
    else:
        assert well_typed(value, hint), value
        if fields_of is not None:
            given = json.loads(data)
            stored = json.loads(json.dumps(fields_of(value)))
            changed = {key for key in stored.keys() & given.keys() if stored[key] != given[key]}
            assert not changed, f"{sorted(changed)} of {given} decoded as {value}"
        return value
    assert "\n" not in message, message
    return None
