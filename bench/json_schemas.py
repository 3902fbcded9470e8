"""A corpus of 60 JSON Schemas for the structured-output benchmarks (bench/grammar_choice.py,
bench/serve_features.py): from flat objects of one type to nested arrays of objects, enums,
consts, required subsets, anyOf/nullable, patterns, formats, numeric ranges and recursion through
$defs. Strings and arrays are bounded (maxLength, maxItems) so a reply that follows the schema
ends within a few hundred tokens whatever the model likes to write."""

from __future__ import annotations

import itertools

NAME = {"type": "string", "maxLength": 16}
TYPES = {
    "string": NAME,
    "integer": {"type": "integer", "minimum": -1000, "maximum": 1000},
    "number": {"type": "number", "minimum": 0, "maximum": 100},
    "boolean": {"type": "boolean"},
    "enum": {"enum": ["low", "medium", "high"]},
    "date": {"type": "string", "format": "date"},
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "nullable": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
}


def _object(props: dict, required=None, closed: bool = True) -> dict:
    out = {"type": "object", "properties": props, "required": list(props) if required is None else required}
    if closed:
        out["additionalProperties"] = False
    return out


def schemas() -> dict[str, dict]:
    """{name: schema}, 60 of them, in a fixed order."""
    out: dict[str, dict] = {}
    for kind, schema in TYPES.items():  # 8: one field of each kind
        out[f"one {kind}"] = _object({"value": schema})
    for a, b in itertools.combinations(list(TYPES), 2):  # 28: two fields
        out[f"{a} and {b}"] = _object({"first": TYPES[a], "second": TYPES[b]})
    for n in (3, 5, 8):  # 3: wide flat objects, some fields optional
        props = {f"f{i}": list(TYPES.values())[i % len(TYPES)] for i in range(n)}
        out[f"{n} fields, half required"] = _object(props, required=list(props)[: (n + 1) // 2])
    for kind in ("string", "integer", "enum", "boolean"):  # 4: arrays of one kind
        out[f"array of {kind}"] = _object({"items": {"type": "array", "items": TYPES[kind], "maxItems": 4}})
    person = _object({"name": NAME, "age": TYPES["integer"], "role": TYPES["enum"]})
    out["array of objects"] = _object(
        {"people": {"type": "array", "items": person, "minItems": 1, "maxItems": 3}}
    )
    out["object in object"] = _object({"owner": person, "since": TYPES["date"]})
    out["three levels"] = _object({"a": _object({"b": _object({"c": TYPES["integer"]})})})
    out["matrix"] = _object(
        {
            "rows": {
                "type": "array",
                "maxItems": 3,
                "items": {"type": "array", "maxItems": 3, "items": TYPES["number"]},
            }
        }
    )
    out["const and enum"] = _object({"version": {"const": 2}, "mode": {"enum": ["a", "b", 3, None]}})
    out["anyOf objects"] = _object(
        {"shape": {"anyOf": [_object({"circle": TYPES["number"]}), _object({"square": TYPES["number"]})]}}
    )
    out["open object"] = {"type": "object", "properties": {"id": TYPES["integer"]}, "required": ["id"]}
    out["top-level array"] = {"type": "array", "items": TYPES["integer"], "minItems": 1, "maxItems": 5}
    out["top-level enum"] = {"enum": ["yes", "no", "maybe"]}
    out["email and uri"] = _object(
        {"mail": {"type": "string", "format": "email"}, "uri": {"type": "string", "format": "uri"}}
    )
    out["string lengths"] = _object({"code": {"type": "string", "minLength": 4, "maxLength": 4}})
    out["integer multiple"] = _object(
        {"even": {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 2}}
    )
    out["tree ($defs, recursive)"] = {
        "$defs": {
            "node": _object(
                {
                    "label": TYPES["enum"],
                    "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}},
                }
            )
        },
        "$ref": "#/$defs/node",
    }
    out["linked list ($defs, recursive)"] = {
        "$defs": {
            "cell": _object(
                {"v": TYPES["integer"], "next": {"anyOf": [{"$ref": "#/$defs/cell"}, {"type": "null"}]}}
            )
        },
        "$ref": "#/$defs/cell",
    }
    out["invoice"] = _object(
        {
            "number": TYPES["pattern"],
            "date": TYPES["date"],
            "lines": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": _object({"item": NAME, "qty": TYPES["integer"], "price": TYPES["number"]}),
            },
            "paid": TYPES["boolean"],
        }
    )
    out["optional nested"] = _object(
        {"meta": _object({"tags": {"type": "array", "items": NAME, "maxItems": 3}}, required=[])}, required=[]
    )
    out["event"] = _object(
        {"when": {"type": "string", "format": "date-time"}, "level": TYPES["enum"], "count": TYPES["integer"]}
    )
    assert len(out) == 60, len(out)
    return out
