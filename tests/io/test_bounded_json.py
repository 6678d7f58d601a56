"""bounded_json: untrusted JSON with its nesting bounded (no RecursionError reaches the caller)."""

from __future__ import annotations

import pytest

from jdeep.io import bounded_json


def test_depth_counts_arrays_and_objects():
    assert bounded_json.depth(3) == 0 and bounded_json.depth([]) == 1 and bounded_json.depth({"a": [1, {}]}) == 3
    deep = []
    for _ in range(5000):            # deeper than the interpreter's recursion limit: counted without recursion
        deep = [deep]
    assert bounded_json.depth(deep, limit=10) == 11


@pytest.mark.parametrize("raw", ["[" * 100000, "[" * 990 + "]" * 990, '{"a":' * 65 + "1" + "}" * 65])
def test_too_deep_is_a_value_error(raw):
    with pytest.raises(bounded_json.TooDeep):
        bounded_json.loads(raw)


def test_within_the_bound_parses():
    raw = "[" * bounded_json.MAX_DEPTH + "]" * bounded_json.MAX_DEPTH
    assert bounded_json.depth(bounded_json.loads(raw)) == bounded_json.MAX_DEPTH
