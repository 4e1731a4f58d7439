"""The constraints the structured-output benchmark compiles and serves.

``NESTED`` is the issue's "nested schema": an object with nested objects, an array of objects, enums,
patterns and bounded strings and numbers, so that every output ends within a few hundred tokens whatever
the weights. ``endless`` wraps a schema in an array that must hold more items than any run generates, so
a constrained request produces exactly ``max_tokens`` tokens, like an unconstrained one with
``ignore_eos``: the two runs do the same work.
"""

import json
from typing import Any

from tokenmill.structured.params import StructuredOutputsParams

NESTED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "name": {"type": "string", "maxLength": 24},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org|net)$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 32},
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "cents": {"type": "integer", "minimum": 0, "maximum": 10000000},
                },
                "required": ["sku", "quantity", "cents"],
                "additionalProperties": False,
            },
        },
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "email", "role", "tags", "address", "orders", "active"],
    "additionalProperties": False,
}
NESTED_INSTANCE: dict[str, Any] = {
    "id": 4211,
    "name": "Ada Lovelace",
    "email": "ada@example.org",
    "role": "editor",
    "tags": ["math", "engines"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
    "orders": [{"sku": "ANE-1843", "quantity": 2, "cents": 12500}],
    "active": True,
}
# What --masks compiles, beside NESTED: name -> constraint.
COMPILED: dict[str, StructuredOutputsParams] = {
    "nested schema": StructuredOutputsParams(json=NESTED),
    "any JSON object": StructuredOutputsParams(json_object=True),
    "regex (email)": StructuredOutputsParams(regex="[a-z]{1,12}@[a-z]{1,12}\\.(com|org|net)"),
    "Lark grammar (sums)": StructuredOutputsParams(grammar='start: NUM ("+" NUM)*\nNUM: /[0-9]{1,6}/'),
}


def endless(schema: dict[str, Any], min_items: int = 100000) -> dict[str, Any]:
    """An array of at least ``min_items`` values of ``schema``: never complete within a benchmark run."""
    return {"type": "array", "items": schema, "minItems": min_items}


def instance_text() -> str:
    """``NESTED_INSTANCE`` as a model would write it: the text whose tokens the mask timing follows."""
    return json.dumps(NESTED_INSTANCE)
