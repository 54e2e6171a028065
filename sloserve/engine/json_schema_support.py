"""Which JSON Schema keywords the structured-output backend enforces.

xgrammar (0.2.9) turns a schema into a grammar and silently drops the keywords it cannot express:
a schema with ``uniqueItems``, ``not`` or two ``allOf`` branches compiles, and the output may
break exactly those constraints. Like vLLM with its xgrammar backend, sloserve refuses such a
schema (HTTP 400 naming the keyword and where it is) instead of returning output that does not
satisfy it. Measured against xgrammar 0.2.9 (a violating and a satisfying string per keyword):

* not enforced, refused: ``uniqueItems: true``, ``contains`` / ``minContains`` /
  ``maxContains``, ``dependentRequired``, ``dependentSchemas``, ``dependencies``, ``not``,
  ``if`` / ``then`` / ``else``, ``allOf`` with more than one schema, a ``format`` outside
  :data:`FORMATS`;
* enforced: type (and lists of types), enum, const, anyOf, $ref / $defs, properties, required,
  additionalProperties, patternProperties, propertyNames, min/maxProperties,
  unevaluatedProperties, items, prefixItems, unevaluatedItems, min/maxItems, min/maxLength,
  pattern, minimum, maximum, exclusiveMinimum/Maximum, multipleOf;
* refused, not fetched: a ``$ref`` that is not local (one not starting with ``#``, such as
  ``http://example.com/x`` or ``other.json#/a``): xgrammar resolves only ``#...`` pointers and
  leaves any other reference unconstrained (it only logs a warning); sloserve fetches nothing;
* accepted with a weaker meaning: ``oneOf`` is treated as ``anyOf`` (vLLM accepts it too; a
  value valid under two branches is not excluded). Annotations (title, description, default,
  examples, contentEncoding, ...) constrain nothing.
"""
from __future__ import annotations

import json

FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6",
                     "uuid", "uri", "uri-reference", "uri-template", "json-pointer",
                     "relative-json-pointer"})

_UNENFORCED = ("contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas",
               "dependencies", "not", "if", "then", "else")

# keywords whose value is one subschema / a map of subschemas / a list of subschemas
_ONE = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items",
        "additionalItems", "unevaluatedItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


#: subschemas nested deeper than this are refused: xgrammar's time grows steeply with depth
#: (parsing alone: 0.07 s at 64 levels, 1.8 s at 200; compiling a 700-deep schema held the
#: core's one compile thread for ~80 s, delaying every structured request behind it)
MAX_DEPTH = 64


def schema_problem(schema) -> str | None:
    """Why ``schema`` (parsed JSON) cannot be served faithfully, or None: the end of a sentence
    that starts "the JSON schema", naming the first keyword the backend would ignore and its
    JSON pointer (``uses "uniqueItems" at /properties/tags, which ...``), or the first subschema
    nested more than :data:`MAX_DEPTH` levels deep.
    """
    why = _first_problem(schema)
    if why is None:
        return _non_local_ref(schema)
    if why.startswith("nests"):
        return why
    return (f"uses {why}, which structured outputs (xgrammar) do not enforce; the schema is "
            f"refused rather than answered with output that may break it")


def _first_problem(schema) -> str | None:
    stack = [(schema, "", 0)]
    while stack:
        node, where, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        at = where or "/"
        if depth > MAX_DEPTH:
            return f"nests subschemas {depth} levels deep at {at[:200]} (the limit is {MAX_DEPTH})"
        for k in _UNENFORCED:
            if k in node:
                return f'"{k}" at {at}'
        if node.get("uniqueItems") is True:
            return f'"uniqueItems" at {at}'
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return f'"allOf" with {len(node["allOf"])} schemas at {at} (one is supported)'
        fmt = node.get("format")
        if fmt is not None and fmt not in FORMATS and node.get("type") in (None, "string"):
            return f'"format": {fmt!r} at {at}'
        for k in _ONE:
            if isinstance(node.get(k), dict):
                stack.append((node[k], f"{where}/{k}", depth + 1))
        for k in _MAP:
            if isinstance(node.get(k), dict):
                for name, sub in node[k].items():
                    stack.append((sub, f"{where}/{k}/{_escape(name)}", depth + 1))
        for k in _LIST:
            if isinstance(node.get(k), list):
                for i, sub in enumerate(node[k]):
                    stack.append((sub, f"{where}/{k}/{i}", depth + 1))
    return None


#: keywords whose value is data, not a schema: a "$ref" inside is a value, not a reference
_DATA = ("const", "enum", "default", "examples")


def _non_local_ref(schema) -> str | None:
    """The first ``$ref`` (anywhere in the schema document, outside data keywords: a local
    ``#/...`` pointer may reach any part of it) that is not local, as the end of a sentence."""
    stack = [(schema, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack.extend((v, f"{where}/{i}") for i, v in reversed(list(enumerate(node))))
            continue
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return (f'refers to {json.dumps(ref)[:200]} ("$ref" at {where or "/"}), which is not '
                    f'a local reference: only references within the schema ("#...") are '
                    f'resolved, nothing is fetched')
        stack.extend((v, f"{where}/{_escape(k)}") for k, v in reversed(list(node.items()))
                     if k not in _DATA)
    return None


def _escape(name: str) -> str:
    """A JSON pointer token (RFC 6901)."""
    return str(name).replace("~", "~0").replace("/", "~1")
