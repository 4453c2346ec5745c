"""Whether a JSON schema allows any finite document at all.

A schema with a `$ref` cycle that has no way out (`{"$ref": "#"}`, an object that requires itself, an
array that must hold itself) compiles into a grammar that allows nothing, or only a document that never
ends: the model would then write until max_tokens and the reply would be no JSON. Such schemas are
refused with a 400 before anything runs (`structured.py`).
"""

from __future__ import annotations

from collections import deque
from typing import Any


def finite_document_problem(schema: Any) -> str | None:
    """Why a JSON schema allows no finite document (a `$ref` cycle with no way out: `{"$ref": "#"}`, an object
    that requires itself, an array that must hold itself), or None. The grammar library compiles those and then
    allows nothing, or only a document that never ends, so they are refused first.

    A least fixpoint over the schema's subschemas (keyed by JSON pointer, as local `$ref`s name them): a
    subschema has a finite document when what it requires has one (its `$ref`'s target and `allOf` all, one of
    `anyOf` / `oneOf`, for an object each required property, for an array its first `minItems` items). Anything
    this does not model counts as having one (the library judges it)."""
    nodes: dict[str, Any] = {}
    _collect(schema, "#", nodes)
    needs = {pointer: _needs(node, pointer, nodes) for pointer, node in nodes.items()}
    waiting: dict[str, list[str]] = {}  # pointer -> the subschemas whose verdict may change when it has a document
    for pointer, groups in needs.items():
        for group in groups:
            for needed in group:
                waiting.setdefault(needed, []).append(pointer)
    finite: set[str] = set()
    queue = deque(nodes)
    while queue:
        pointer = queue.popleft()
        if pointer in finite or not all(any(p in finite for p in group) for group in needs[pointer]):
            continue
        finite.add(pointer)
        queue.extend(waiting.get(pointer, ()))
    if "#" in finite:
        return None
    refs = [n["$ref"] for n in nodes.values() if isinstance(n, dict) and isinstance(n.get("$ref"), str)]
    cycle = next((ref for ref in refs if ref not in finite), None)
    where = f": every document of '{cycle}' must hold another one ($ref cycles with no way out)" if cycle else ""
    return f"it allows no finite document{where}"


SKIPPED = frozenset({"enum", "const", "default", "examples", "description", "title"})  # values, not subschemas


def _collect(node: Any, pointer: str, nodes: dict[str, Any]) -> None:
    if not isinstance(node, (dict, bool)):
        return
    nodes[pointer] = node
    if isinstance(node, bool):
        return
    for key, value in node.items():
        if key in SKIPPED:
            continue
        at = f"{pointer}/{str(key).replace('~', '~0').replace('/', '~1')}"
        if isinstance(value, list):
            for index, item in enumerate(value):
                _collect(item, f"{at}/{index}", nodes)
        elif isinstance(value, dict):
            if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
                for name, item in value.items():
                    _collect(item, f"{at}/{str(name).replace('~', '~0').replace('/', '~1')}", nodes)
            else:
                _collect(value, at, nodes)


def _needs(node: Any, pointer: str, nodes: dict[str, Any]) -> list[list[str]]:
    """What `node` needs for a finite document: groups of subschemas, one of each group having one (an empty
    group: never; no groups: always)."""
    never: list[list[str]] = [[]]
    if isinstance(node, bool):
        return [] if node else never
    groups: list[list[str]] = []
    ref = node.get("$ref")
    if isinstance(ref, str) and ref in nodes:  # other references (remote, anchors): the library's to judge
        groups.append([ref])
    if isinstance(node.get("allOf"), list):
        groups += [[f"{pointer}/allOf/{i}"] for i in range(len(node["allOf"]))]
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            groups.append([f"{pointer}/{key}/{i}" for i in range(len(node[key]))])
    if "const" in node or "enum" in node:
        return groups
    kinds = node.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list) or any(k not in ("object", "array") for k in kinds):
        return groups  # untyped (any value) or a scalar type allowed: finite as far as its type goes
    options: list[list[list[str]]] = []
    if "object" in kinds:
        options.append(_object_needs(node, pointer, nodes))
    if "array" in kinds:
        options.append(_array_needs(node, pointer))
    if len(options) == 1:
        return groups + options[0]
    return groups  # an object or an array: either may end (one of two lists of needs is not modelled)


def _object_needs(node: dict[str, Any], pointer: str, nodes: dict[str, Any]) -> list[list[str]]:
    properties: dict[str, Any] = node["properties"] if isinstance(node.get("properties"), dict) else {}
    groups: list[list[str]] = []
    for name in node.get("required") or []:
        if not isinstance(name, str):
            continue
        if name in properties:
            groups.append([f"{pointer}/properties/{name.replace('~', '~0').replace('/', '~1')}"])
        elif node.get("additionalProperties") is False:
            return [[]]
        elif isinstance(node.get("additionalProperties"), dict):
            groups.append([f"{pointer}/additionalProperties"])
    return groups


def _array_needs(node: dict[str, Any], pointer: str) -> list[list[str]]:
    num_items: int = node["minItems"] if isinstance(node.get("minItems"), int) else 0
    prefix: list[Any] = node["prefixItems"] if isinstance(node.get("prefixItems"), list) else []
    groups = [[f"{pointer}/prefixItems/{i}"] for i in range(min(num_items, len(prefix)))]
    if num_items > len(prefix):
        items = node.get("items")
        if items is False:
            return [[]]
        if isinstance(items, dict):
            groups.append([f"{pointer}/items"])
    return groups
