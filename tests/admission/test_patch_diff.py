"""The diff behind every patch: exact on any JSON, and cheap because drafts share subtrees."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
from hypothesis import given, settings
from hypothesis import strategies as st

from xmem_admission.cluster.kube.jsonpatch import Draft, diff, pointer

keys = st.text(alphabet=st.sampled_from("ab/~.-_xyz0"), min_size=0, max_size=4)
scalars = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.text(max_size=3)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=25,
)


@settings(max_examples=400, deadline=None)
@given(json_values, json_values)
def test_applying_the_diff_of_two_documents_turns_one_into_the_other(a: Any, b: Any) -> None:
    before = copy.deepcopy(a)
    ops = diff(a, b)
    assert a == before
    result = jsonpatch.apply_patch(copy.deepcopy(a), ops)
    assert result == b and _types(result) == _types(b)


def _types(value: Any) -> Any:
    """The value with every scalar's JSON type spelled out (True is not 1 in JSON)."""
    if isinstance(value, dict):
        return {k: _types(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_types(v) for v in value]
    return (type(value).__name__, value)


def test_equal_documents_give_no_operations() -> None:
    doc = {"a": [1, {"b": None}], "c": "x"}
    assert diff(doc, copy.deepcopy(doc)) == []


def test_true_and_one_are_different_values() -> None:
    assert diff({"a": 1}, {"a": True}) == [{"op": "replace", "path": "/a", "value": True}]


def test_keys_with_slashes_and_tildes_are_escaped() -> None:
    ops = diff({}, {"nvidia.com/gpu": "1", "a~b": 2})
    assert {op["path"] for op in ops} == {"/nvidia.com~1gpu", "/a~0b"}
    assert pointer(("metadata", "annotations", "xmem.io/request-bytes")) == (
        "/metadata/annotations/xmem.io~1request-bytes"
    )


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(keys, json_values, max_size=5), keys, keys, json_values)
def test_a_draft_never_writes_through_to_the_original(original: Any, k1: str, k2: str, value: Any) -> None:
    frozen = copy.deepcopy(original)
    draft = Draft(original)
    draft.set(("spec", k1, k2), value)
    draft.delete((k1,))
    assert original == frozen
    assert jsonpatch.apply_patch(copy.deepcopy(original), diff(original, draft.root)) == draft.root


def test_untouched_subtrees_are_shared_not_copied() -> None:
    big = {"spec": {"template": {"spec": {"containers": [{"name": "c"}]}}}, "status": {"x": [1] * 1000}}
    draft = Draft(big)
    draft.set(("spec", "template", "metadata", "labels", "a"), "b")
    assert draft.root["status"] is big["status"]
    assert draft.root["spec"]["template"]["spec"] is big["spec"]["template"]["spec"]
    assert diff(big, draft.root) == [
        {"op": "add", "path": "/spec/template/metadata", "value": {"labels": {"a": "b"}}}
    ]
