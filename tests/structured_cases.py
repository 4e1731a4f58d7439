"""The constraints the structured-output tests generate under: JSON schemas of varied features (enums,
nesting, arrays of arrays, recursive and shared ``$ref``s, anyOf / oneOf / allOf, patterns, formats, bounds,
nullable types, const), regexes, choices and grammars, each with an example instance for its prompt."""

from typing import Any

# Name -> (schema, an instance the prompt shows). Strings, arrays and numbers are bounded and objects
# closed (open ones take bounded keys and values), where a small model would otherwise ramble past max_tokens.
SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "person": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {"name": "Ada", "age": 36},
    ),
    "enum": (
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}},
            "required": ["color"],
            "additionalProperties": False,
        },
        {"color": "green"},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 20},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["city", "zip"],
                    "additionalProperties": False,
                }
            },
            "required": ["address"],
            "additionalProperties": False,
        },
        {"address": {"city": "Paris", "zip": "75001"}},
    ),
    "tags": (
        {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}
            },
            "required": ["tags"],
            "additionalProperties": False,
        },
        {"tags": ["red", "fast"]},
    ),
    "matrix": (
        {
            "type": "object",
            "properties": {
                "matrix": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {
                        "type": "array",
                        "maxItems": 3,
                        "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    },
                }
            },
            "required": ["matrix"],
            "additionalProperties": False,
        },
        {"matrix": [[1, 2], [3, 4]]},
    ),
    "tree": (
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "value": {"type": "integer", "minimum": 0, "maximum": 99},
                        "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["value", "children"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
        {"value": 1, "children": [{"value": 2, "children": []}]},
    ),
    "anyof": (
        {
            "type": "object",
            "properties": {
                "id": {
                    "anyOf": [
                        {"type": "integer", "minimum": 0, "maximum": 1000},
                        {"type": "string", "maxLength": 8},
                    ]
                }
            },
            "required": ["id"],
            "additionalProperties": False,
        },
        {"id": 42},
    ),
    "oneof": (
        {
            "type": "object",
            "properties": {
                "shape": {
                    "oneOf": [
                        {
                            "type": "object",
                            "properties": {"radius": {"type": "integer", "minimum": 1, "maximum": 9}},
                            "required": ["radius"],
                            "additionalProperties": False,
                        },
                        {
                            "type": "object",
                            "properties": {"side": {"type": "string", "enum": ["a", "b"]}},
                            "required": ["side"],
                            "additionalProperties": False,
                        },
                    ]
                }
            },
            "required": ["shape"],
            "additionalProperties": False,
        },
        {"shape": {"radius": 3}},
    ),
    "bool_null": (
        {
            "type": "object",
            "properties": {
                "active": {"type": "boolean"},
                "note": {"type": ["string", "null"], "maxLength": 10},
            },
            "required": ["active", "note"],
            "additionalProperties": False,
        },
        {"active": True, "note": None},
    ),
    "const": (
        {
            "type": "object",
            "properties": {"version": {"const": "1.0"}, "ok": {"type": "boolean"}},
            "required": ["version", "ok"],
            "additionalProperties": False,
        },
        {"version": "1.0", "ok": True},
    ),
    "number": (
        {
            "type": "object",
            "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 50}},
            "required": ["celsius"],
            "additionalProperties": False,
        },
        {"celsius": 21.5},
    ),
    "pattern": (
        {
            "type": "object",
            "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
            "required": ["phone"],
            "additionalProperties": False,
        },
        {"phone": "555-0199"},
    ),
    "closed": (
        {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 9},
                "b": {"type": "string", "maxLength": 5},
            },
            "additionalProperties": False,
        },
        {"a": 1, "b": "x"},
    ),
    "objects": (
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "id": {"type": "integer", "minimum": 0, "maximum": 99},
                            "name": {"type": "string", "maxLength": 10},
                        },
                        "required": ["id", "name"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["items"],
            "additionalProperties": False,
        },
        {"items": [{"id": 1, "name": "pen"}]},
    ),
    "weekdays": (
        {
            "type": "object",
            "properties": {
                "days": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                }
            },
            "required": ["days"],
            "additionalProperties": False,
        },
        {"days": ["mon", "fri"]},
    ),
    "allof": (
        {
            "allOf": [
                {
                    "type": "object",
                    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["x"],
                },
                {
                    "type": "object",
                    "properties": {"y": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["y"],
                },
            ]
        },
        {"x": 1, "y": 2},
    ),
    "top_array": (
        {
            "type": "array",
            "minItems": 1,
            "maxItems": 5,
            "items": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        [1, 2, 3],
    ),
    "code": (
        {
            "type": "object",
            "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 6, "pattern": "^[A-Z]+$"}},
            "required": ["code"],
            "additionalProperties": False,
        },
        {"code": "ABC"},
    ),
    "deep": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "profile": {
                            "type": "object",
                            "properties": {"nickname": {"type": "string", "maxLength": 12}},
                            "required": ["nickname"],
                            "additionalProperties": False,
                        }
                    },
                    "required": ["profile"],
                    "additionalProperties": False,
                }
            },
            "required": ["user"],
            "additionalProperties": False,
        },
        {"user": {"profile": {"nickname": "ace"}}},
    ),
    "nullable_int": (
        {
            "type": "object",
            "properties": {"count": {"type": ["integer", "null"], "minimum": 0, "maximum": 50}},
            "required": ["count"],
            "additionalProperties": False,
        },
        {"count": 3},
    ),
    "refs": (
        {
            "$defs": {
                "point": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": -9, "maximum": 9},
                        "y": {"type": "integer", "minimum": -9, "maximum": 9},
                    },
                    "required": ["x", "y"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
            "required": ["start", "end"],
            "additionalProperties": False,
        },
        {"start": {"x": 0, "y": 0}, "end": {"x": 1, "y": 2}},
    ),
    "linked": (
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer", "minimum": 0, "maximum": 9},
                        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
                    },
                    "required": ["v", "next"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
        {"v": 1, "next": {"v": 2, "next": None}},
    ),
    "date": (
        {
            "type": "object",
            "properties": {"day": {"type": "string", "format": "date"}},
            "required": ["day"],
            "additionalProperties": False,
        },
        {"day": "2024-05-17"},
    ),
    "open_object": (
        {
            "type": "object",
            "patternProperties": {"^[a-z]{1,10}$": {"type": ["integer", "boolean", "null"]}},
            "additionalProperties": False,
            "maxProperties": 3,
        },
        {"ok": True, "count": 2},
    ),
}
# Name -> (regex, an example). Python's re and both backends read these alike ([0-9], not \d).
REGEXES: dict[str, tuple[str, str]] = {
    "phone": ("[0-9]{3}-[0-9]{4}", "555-0199"),
    "answer": ("(yes|no|maybe)", "maybe"),
    "name": ("[A-Z][a-z]{2,8}", "Alice"),
    "email": ("[a-z]{1,10}@[a-z]{1,10}\\.(com|org)", "bob@mail.com"),
    "decimal": ("(0|[1-9][0-9]{0,3})(\\.[0-9]{1,2})?", "3.14"),
    "hex": ("#[0-9a-f]{6}", "#00ff7f"),
    "isodate": ("[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", "2024-05-17"),
    "words": ("[a-z]{1,10}( [a-z]{1,10}){0,3}\\.", "the cat sat."),
}
# Name -> (choices, an example).
CHOICES: dict[str, tuple[list[str], str]] = {
    "colors": (["red", "green", "blue"], "green"),
    "verdict": (["yes", "no", "not sure"], "not sure"),
}
# Name -> (grammar, a Python regex of the same language, an example): Lark and GBNF, at most three terms
# (a small model would add terms forever).
GRAMMARS: dict[str, tuple[str, str, str]] = {
    "sum_lark": (
        'start: NUM ("+" NUM)? ("+" NUM)?\nNUM: /[0-9]{1,3}/',
        r"[0-9]{1,3}(\+[0-9]{1,3}){0,2}",
        "12+7",
    ),
    "sum_gbnf": (
        'root ::= num ("+" num)? ("+" num)?\nnum ::= [0-9] [0-9]? [0-9]?',
        r"[0-9]{1,3}(\+[0-9]{1,3}){0,2}",
        "3+45",
    ),
}
