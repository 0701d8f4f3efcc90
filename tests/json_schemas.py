"""JSON schemas for the structured-output tests and bench/structured.py: the shapes real APIs use
(nested objects, bounded arrays, enums, const, patterns, formats, anyOf / oneOf, $ref and
recursion, closed objects, bounded numbers). Strings are mostly bounded, so that a small model's
outputs finish within the tests' token budgets."""
from __future__ import annotations

from typing import Any

NAME = {"type": "string", "maxLength": 16}
SHORT = {"type": "string", "maxLength": 24}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}


def obj(properties: dict[str, Any], required: list[str] | None = None,
        closed: bool = True) -> dict[str, Any]:
    """An object with these properties, all required unless said otherwise."""
    schema = {"type": "object", "properties": properties,
              "required": list(properties) if required is None else required}
    if closed:
        schema["additionalProperties"] = False
    return schema


TREE = {"$defs": {"node": obj({"value": {"type": "integer", "minimum": 0, "maximum": 9},
                               "children": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                            "maxItems": 2}})},
        "$ref": "#/$defs/node"}
LINKED_LIST = {"$defs": {"item": obj({"label": NAME, "next": {"anyOf": [
    {"$ref": "#/$defs/item"}, {"type": "null"}]}})}, "$ref": "#/$defs/item"}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("person", obj({"name": NAME, "age": AGE})),
    ("person_optional_email", obj({"name": NAME, "email": {"type": "string", "format": "email",
                                                           "maxLength": 40}}, ["name"])),
    ("boolean_flag", obj({"enabled": {"type": "boolean"}})),
    ("null_field", obj({"value": {"type": "null"}})),
    ("number_unit", obj({"x": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("integer_range", obj({"n": {"type": "integer", "minimum": 10, "maximum": 20}})),
    ("exclusive_bounds", obj({"t": {"type": "number", "exclusiveMinimum": -5,
                                    "exclusiveMaximum": 5}})),
    ("negative_int", obj({"n": {"type": "integer", "maximum": -1, "minimum": -1000}})),
    ("enum_color", obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("enum_mixed", obj({"v": {"enum": [1, "two", None, True]}})),
    ("const_version", obj({"version": {"const": "1.0"}, "name": NAME})),
    ("const_number", obj({"kind": {"const": 7}})),
    ("pattern_zip", obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("pattern_code", obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"}})),
    ("pattern_hex", obj({"color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("format_date_time", obj({"at": {"type": "string", "format": "date-time"}})),
    ("format_date", obj({"day": {"type": "string", "format": "date"}})),
    ("format_email", obj({"email": {"type": "string", "format": "email", "maxLength": 40}})),
    ("format_uuid", obj({"id": {"type": "string", "format": "uuid"}})),
    ("string_length", obj({"s": {"type": "string", "minLength": 3, "maxLength": 6}})),
    ("array_ints", obj({"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                          "maximum": 99},
                               "minItems": 1, "maxItems": 4}})),
    ("array_exact", obj({"pair": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                             "maximum": 9},
                                  "minItems": 2, "maxItems": 2}})),
    ("array_strings", obj({"tags": {"type": "array", "items": NAME, "minItems": 1,
                                    "maxItems": 3}})),
    ("array_enum", obj({"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]},
                                 "maxItems": 3}})),
    ("array_objects", obj({"people": {"type": "array", "items": obj({"name": NAME, "age": AGE}),
                                      "minItems": 1, "maxItems": 2}})),
    ("tuple_prefix_items", obj({"point": {"type": "array", "prefixItems": [
        {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}],
        "items": False}})),
    ("nested_address", obj({"name": NAME, "address": obj({"city": NAME, "zip": {
        "type": "string", "pattern": "^[0-9]{5}$"}})})),
    ("nested_three_levels", obj({"a": obj({"b": obj({"c": {"type": "integer", "minimum": 0,
                                                           "maximum": 9}})})})),
    ("nested_array_of_arrays", obj({"grid": {"type": "array", "maxItems": 2, "minItems": 1,
                                             "items": {"type": "array", "maxItems": 2,
                                                       "items": {"type": "integer",
                                                                 "minimum": 0,
                                                                 "maximum": 9}}}})),
    ("any_of_scalar", obj({"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                           {"type": "boolean"}]}})),
    ("any_of_objects", obj({"shape": {"anyOf": [
        obj({"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1,
                                                "maximum": 9}}),
        obj({"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                   "maximum": 9}})]}})),
    ("one_of_disjoint", obj({"id": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                              {"type": "string", "pattern": "^x[0-9]{3}$"}]}})),
    ("nullable_string", obj({"nickname": {"type": ["string", "null"], "maxLength": 10}})),
    ("type_list", obj({"v": {"type": ["integer", "boolean"], "minimum": 0, "maximum": 5}})),
    ("ref_defs", {"$defs": {"name": NAME}, **obj({"first": {"$ref": "#/$defs/name"},
                                                  "last": {"$ref": "#/$defs/name"}})}),
    ("ref_definitions", {"definitions": {"age": AGE},
                         **obj({"age": {"$ref": "#/definitions/age"}})}),
    ("recursive_tree", TREE),
    ("recursive_linked_list", LINKED_LIST),
    ("optional_fields", obj({"a": {"type": "integer", "minimum": 0, "maximum": 9},
                             "b": NAME, "c": {"type": "boolean"}}, ["a"])),
    ("no_required", obj({"a": {"type": "boolean"}, "b": {"type": "boolean"}}, [])),
    ("open_object", obj({"name": NAME}, closed=False)),
    ("additional_properties_typed", {"type": "object", "properties": {},
                                     "additionalProperties": {"type": "integer", "minimum": 0,
                                                              "maximum": 9},
                                     "maxProperties": 2}),
    ("product", obj({"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
                     "price": {"type": "number", "minimum": 0, "maximum": 1000},
                     "in_stock": {"type": "boolean"}})),
    ("event", obj({"title": SHORT, "start": {"type": "string", "format": "date-time"},
                   "attendees": {"type": "array", "items": {"type": "string", "format": "email",
                                                            "maxLength": 30},
                                 "maxItems": 2}})),
    ("user_profile", obj({"id": {"type": "string", "format": "uuid"}, "username": {
        "type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"}, "role": {
        "enum": ["admin", "user", "guest"]}})),
    ("weather", obj({"city": NAME, "temperature_c": {"type": "number", "minimum": -60,
                                                     "maximum": 60},
                     "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}})),
    ("order", obj({"order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
                   "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": obj({
                       "name": NAME, "qty": {"type": "integer", "minimum": 1,
                                             "maximum": 9}})}})),
    ("rgb", obj({"r": {"type": "integer", "minimum": 0, "maximum": 255},
                 "g": {"type": "integer", "minimum": 0, "maximum": 255},
                 "b": {"type": "integer", "minimum": 0, "maximum": 255}})),
    ("coordinates", obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                         "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
    ("status_response", obj({"ok": {"type": "boolean"}, "error": {"anyOf": [
        {"type": "null"}, {"type": "string", "maxLength": 20}]}})),
    ("key_value_list", obj({"pairs": {"type": "array", "maxItems": 2, "items": obj({
        "key": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "value": {
            "type": "integer", "minimum": 0, "maximum": 99}})}})),
    ("top_level_array", {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                    "maximum": 9},
                         "minItems": 1, "maxItems": 3}),
    ("top_level_enum", {"enum": ["alpha", "beta", "gamma"]}),
    ("top_level_integer", {"type": "integer", "minimum": 1, "maximum": 6}),
    ("all_of_merge", {"allOf": [obj({"a": {"type": "boolean"}}, closed=False),
                                obj({"b": {"type": "boolean"}}, closed=False)],
                      "type": "object"}),
]
