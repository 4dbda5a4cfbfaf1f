"""Hypothesis strategies from JSON Schema: the subset server/openapi.py writes (type lists,
enum, const, anyOf, objects with properties / required / additionalProperties, arrays
with items and sizes, numeric bounds, minLength). Optional properties are drawn or left
out at random; an open object (no properties) gets small arbitrary JSON values."""

from __future__ import annotations

from hypothesis import strategies as st

ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def from_schema(schema: dict) -> st.SearchStrategy:
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([from_schema(s) for s in schema["anyOf"]])
    kinds = schema.get("type")
    if kinds is None:
        return ANY_JSON
    if isinstance(kinds, list):
        return st.one_of([from_schema({**schema, "type": kind}) for kind in kinds])
    return _TYPES[kinds](schema)


def _number(schema: dict, integers: bool) -> st.SearchStrategy:
    low, high = schema.get("minimum"), schema.get("maximum")
    if integers:
        return st.integers(min_value=low, max_value=high)
    exclusive = schema.get("exclusiveMinimum")
    return st.floats(min_value=exclusive if exclusive is not None else low, max_value=high,
                     exclude_min=exclusive is not None, allow_nan=False, allow_infinity=False)


def _array(schema: dict) -> st.SearchStrategy:
    items = from_schema(schema["items"]) if "items" in schema else ANY_JSON
    return st.lists(items, min_size=schema.get("minItems", 0), max_size=schema.get("maxItems", 4))


def _object(schema: dict) -> st.SearchStrategy:
    props = schema.get("properties")
    if props is None:
        extra = schema.get("additionalProperties")
        values = from_schema(extra) if isinstance(extra, dict) else ANY_JSON
        return st.dictionaries(st.text(max_size=8), values, max_size=3)
    required = set(schema.get("required", ()))
    return st.fixed_dictionaries(
        {k: from_schema(s) for k, s in props.items() if k in required},
        optional={k: from_schema(s) for k, s in props.items() if k not in required},
    )


_TYPES = {
    "null": lambda s: st.none(),
    "boolean": lambda s: st.booleans(),
    "integer": lambda s: _number(s, integers=True),
    "number": lambda s: _number(s, integers=False),
    "string": lambda s: st.text(min_size=s.get("minLength", 0), max_size=max(24, s.get("minLength", 0))),
    "array": _array,
    "object": _object,
}
