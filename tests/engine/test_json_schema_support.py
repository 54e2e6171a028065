"""JSON schemas with keywords xgrammar would drop are refused, naming the keyword and where;
the keywords it enforces pass."""
from __future__ import annotations

import json

import pytest

from sloserve.engine.json_schema_support import MAX_DEPTH, _first_problem, schema_problem


@pytest.mark.parametrize("schema,why", [
    ({"type": "array", "uniqueItems": True}, '"uniqueItems" at /'),
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
     '"uniqueItems" at /properties/tags'),
    ({"type": "array", "items": {"type": "integer", "not": {"const": 1}}}, '"not" at /items'),
    ({"type": "array", "contains": {"const": 5}}, '"contains" at /'),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, '"dependentRequired" at /'),
    ({"if": {"minimum": 5}, "then": {"maximum": 3}}, '"if" at /'),
    ({"allOf": [{"type": "integer"}, {"maximum": 3}]}, '"allOf" with 2 schemas at / (one is supported)'),
    ({"$defs": {"a/b": {"type": "string", "format": "idn-email"}}, "$ref": "#/$defs/a~1b"},
     "\"format\": 'idn-email' at /$defs/a~1b"),
    ({"anyOf": [{"type": "null"}, {"prefixItems": [{"type": "integer"}, {"not": {}}]}]},
     '"not" at /anyOf/1/prefixItems/1'),
])
def test_unenforced_keywords_are_named(schema, why):
    assert _first_problem(schema) == why
    assert schema_problem(schema).startswith(f"uses {why}, which structured outputs (xgrammar) do not enforce")


def test_enforced_schemas_pass():
    schema = {
        "title": "Person", "type": "object", "additionalProperties": False,
        "properties": {
            "name": {"type": "string", "minLength": 1, "pattern": "^[A-Z]"},
            "born": {"type": "string", "format": "date"},
            "age": {"anyOf": [{"type": "integer", "minimum": 0, "multipleOf": 1}, {"type": "null"}]},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3,
                     "uniqueItems": False},
            "kind": {"oneOf": [{"const": "x"}, {"const": "y"}]},
            "extra": {"allOf": [{"$ref": "#/$defs/e"}]},
            "not": {"type": "string"},  # a property named like a keyword is a property
        },
        "required": ["name"], "$defs": {"e": {"type": "object", "maxProperties": 2}},
    }
    assert schema_problem(schema) is None


def test_nesting_depth_is_bounded():
    def nested(depth):
        s = {"type": "integer"}
        for _ in range(depth):
            s = {"type": "object", "properties": {"a": s}}
        return s
    assert schema_problem(nested(MAX_DEPTH)) is None
    why = schema_problem(nested(MAX_DEPTH + 1))
    assert why.startswith(f"nests subschemas {MAX_DEPTH + 1} levels deep at /properties/a/")
    assert why.endswith(f"(the limit is {MAX_DEPTH})")


def test_validate_refuses_with_a_clear_message():
    from sloserve.engine.structured_output import validate
    from sloserve.sampling_params import StructuredOutputsParams
    spec = StructuredOutputsParams(json=json.dumps({"type": "array", "uniqueItems": True}))
    with pytest.raises(ValueError, match=r'uses "uniqueItems" at /, which structured outputs '
                                         r'\(xgrammar\) do not enforce'):
        validate(spec)
    validate(StructuredOutputsParams(json=json.dumps({"type": "array", "maxItems": 2})))


def test_json_object_means_an_object():
    """``response_format: json_object`` took xgrammar's builtin JSON grammar, which also accepts
    a top-level array (a seeded sample at temperature 0.8 produced one in CI)."""
    pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    from sloserve.engine.structured_output import _grammar
    from sloserve.sampling_params import StructuredOutputsParams
    g = _grammar(StructuredOutputsParams(json_object=True))
    assert [_is_grammar_accept_string(g, s) for s in
            ['{"a": 1}', '{}', '{"a": {"b": [1, 2]}}', '{\n  "x": "y"\n}', '[1]', '"s"', '1']] == \
        [True, True, True, True, False, False, False]


@pytest.mark.parametrize("schema,ref,at", [
    ({"$ref": "http://example.com/x"}, "http://example.com/x", "/"),
    ({"type": "object", "properties": {"a": {"$ref": "other.json#/a"}}}, "other.json#/a",
     "/properties/a"),
    ({"type": "array", "items": [{"$ref": "urn:x"}]}, "urn:x", "/items/0"),
    # a local pointer may reach any part of the document, so every part is checked
    ({"x": {"y": {"$ref": "https://e/s"}}, "$ref": "#/x/y"}, "https://e/s", "/x/y"),
])
def test_non_local_refs_are_refused(schema, ref, at):
    """xgrammar leaves a non-local $ref unconstrained (it only logs a warning); nothing is
    fetched, the schema is refused naming the reference and where it is."""
    why = schema_problem(schema)
    assert why == (f'refers to "{ref}" ("$ref" at {at}), which is not a local reference: only '
                   f'references within the schema ("#...") are resolved, nothing is fetched')


def test_local_refs_and_data_that_looks_like_a_ref_pass():
    assert schema_problem({"$defs": {"a": {"type": "string"}}, "$ref": "#/$defs/a"}) is None
    assert schema_problem({"type": "object", "properties": {"$ref": {"type": "string"}},
                           "default": {"$ref": "http://x"}, "examples": [{"$ref": "y"}],
                           "enum": [{"$ref": "z"}], "const": {"$ref": "w"}}) is None
