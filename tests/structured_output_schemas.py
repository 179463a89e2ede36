"""The JSON Schemas the structured-output tests ask for, by name: flat and nested objects,
arrays, enums, anyOf, const, formats, bounds, optional and nullable fields, `$defs`
references and every JSON type.
"""

from __future__ import annotations

SHORT = {"type": "string", "maxLength": 6}
SCHEMAS: dict[str, dict] = {
    "flat": {
        "type": "object",
        "properties": {"name": SHORT, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": SHORT,
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": SHORT,
                            "zip": {"type": "string", "pattern": r"^\d{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "array_bounds": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {"id": {"anyOf": [{"type": "integer"}, SHORT]}},
        "required": ["id"],
        "additionalProperties": False,
    },
    "const": {
        "type": "object",
        "properties": {"version": {"const": 2}, "kind": {"const": "tallow"}},
        "required": ["version", "kind"],
        "additionalProperties": False,
    },
    "pattern": {"type": "string", "pattern": r"^[A-Z]{3}-\d{2}$"},
    "length": {"type": "string", "minLength": 3, "maxLength": 5},
    "date": {
        "type": "object",
        "properties": {"born": {"type": "string", "format": "date"}},
        "required": ["born"],
        "additionalProperties": False,
    },
    "int_bounds": {
        "type": "object",
        "properties": {
            "small": {"type": "integer", "minimum": -5, "maximum": 5},
            "big": {"type": "integer", "minimum": 1000},
        },
        "required": ["small", "big"],
        "additionalProperties": False,
    },
    "number_bounds": {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "temp": {"type": "number", "exclusiveMinimum": -10, "exclusiveMaximum": 40},
        },
        "required": ["ratio", "temp"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"type": "integer"}, "c": SHORT},
        "required": ["a"],
        "additionalProperties": False,
    },
    "nullable": {
        "type": "object",
        "properties": {"note": {"type": ["string", "null"], "maxLength": 4}},
        "required": ["note"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "matrix": {
        "type": "array",
        "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
        "minItems": 2,
        "maxItems": 2,
    },
    "mixed_enum": {"enum": [1, "one", None, True, 2.5]},
    "extra_props_typed": {
        "type": "object",
        "properties": {"id": {"type": "integer"}},
        "required": ["id"],
        "additionalProperties": {"type": "integer"},
    },
    "defs_ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}},
                "required": ["x"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "top_level_bool": {"type": "boolean"},
    "tags": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["x", "y", "z"]},
                "minItems": 1,
                "maxItems": 5,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "all_types": {
        "type": "object",
        "properties": {
            "s": {"type": "string", "pattern": r"^[a-z]+$", "maxLength": 4},
            "i": {"type": "integer", "maximum": -1},
            "n": {"type": "number"},
            "b": {"type": "boolean"},
            "z": {"type": "null"},
            "a": {"type": "array", "maxItems": 2, "items": {"type": "boolean"}},
        },
        "required": ["s", "i", "n", "b", "z", "a"],
        "additionalProperties": False,
    },
    "one_key_optional_nested": {
        "type": "object",
        "properties": {
            "meta": {
                "type": "object",
                "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "integer", "minimum": 1}},
                "required": ["k"],
                "additionalProperties": False,
            }
        },
        "additionalProperties": False,
    },
}
