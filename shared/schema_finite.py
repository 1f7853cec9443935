"""Whether a JSON schema's parts all have a finite value, before llguidance runs it.

llguidance lets a model begin any property a schema declares: it writes the key, then finds the
value's grammar. A part with no finite value (a `$ref` cycle without a base case, such as
`{"$defs": {"a": {"$ref": "#/$defs/a"}}}`, or an object that requires itself) compiles and
masks its first tokens; the answer then meets a dead end mid-way, where no token continues it.
Such a schema is refused up front, naming the part.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

_ONE = ("items", "additionalProperties", "contains", "then", "else", "not")
_EACH = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def infinite_part(schema: Any) -> str | None:
    """The JSON pointer of a part of `schema` a value may enter that has no finite value (the
    root is "#"); None when every such part has one. Only local `$ref`s ("#/...") are followed."""
    nodes = dict(_subschemas(schema, "#"))
    needs = {pointer: _needs(pointer, node, nodes) for pointer, node in nodes.items()}
    needed_by: dict[str, list[str]] = {}
    for pointer, parts in needs.items():
        for part in parts:
            needed_by.setdefault(part, []).append(pointer)
    # The least fixpoint, by a worklist: a part is re-checked only when one it needs turns finite.
    finite: set[str] = set()
    work = list(nodes)
    while work:
        pointer = work.pop()
        if pointer not in finite and _finite_given(pointer, nodes[pointer], finite, nodes):
            finite.add(pointer)
            work.extend(needed_by.get(pointer, ()))
    for pointer in _entered(schema, nodes):
        if pointer not in finite:
            return pointer
    return None


def _subschemas(schema: Any, root: str) -> Iterator[tuple[str, Any]]:
    """Every dict or bool schema under `schema`, by JSON pointer, parents first (a loop, not
    recursion: a schema may nest as deep as its 32 Ki characters allow)."""
    stack = [(root, schema)]
    while stack:
        pointer, node = stack.pop()
        if not isinstance(node, dict | bool):
            continue
        yield pointer, node
        if isinstance(node, dict):
            stack.extend(reversed([(f"{pointer}/{key}", value) for key, value in _children(node)]))


def _children(node: dict) -> Iterator[tuple[str, Any]]:
    for key in _ONE:
        if isinstance(node.get(key), dict | bool):
            yield key, node[key]
    for key in _EACH:
        if isinstance(node.get(key), list):
            for n, member in enumerate(node[key]):
                yield f"{key}/{n}", member
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            for name, member in node[key].items():
                yield f"{key}/{_escape(str(name))}", member


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _target(node: dict) -> str | None:
    """The pointer a local `$ref` names ("#" alone is the root); None for none or a remote one."""
    ref = node.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    return ref.rstrip("/") or "#"


def _needs(pointer: str, node: Any, nodes: dict[str, Any]) -> list[str]:
    """The parts whose finiteness `node`'s depends on (what `_finite_given` reads)."""
    if not isinstance(node, dict):
        return []
    lists = {
        key: node[key]
        for key in ("allOf", "anyOf", "oneOf", "prefixItems", "required")
        if isinstance(node.get(key), list)
    }
    parts = [f"{pointer}/{key}/{n}" for key, members in lists.items() if key != "required" for n in range(len(members))]
    parts += [f"{pointer}/properties/{_escape(name)}" for name in lists.get("required", []) if isinstance(name, str)]
    target = _target(node)
    if target is not None and target in nodes:
        parts.append(target)
    return [*parts, f"{pointer}/items"]


def _finite_given(pointer: str, node: Any, finite: set[str], nodes: dict[str, Any]) -> bool:
    """Whether `node` has a finite value when the parts in `finite` have one: its `$ref`, every
    `allOf` member, one `anyOf`/`oneOf` member, its required properties, its first minItems items."""
    if isinstance(node, bool):
        return node  # `false` admits nothing; a value never enters it
    target = _target(node)
    if target is not None and target in nodes and target not in finite:  # one that resolves nowhere: not ours
        return False
    members = {key: node[key] for key in ("allOf", "anyOf", "oneOf") if isinstance(node.get(key), list)}
    ok = {key: [f"{pointer}/{key}/{n}" in finite for n in range(len(m))] for key, m in members.items()}
    if not all(ok.get("allOf", [])) or not all(any(ok[key]) for key in ("anyOf", "oneOf") if key in ok):
        return False
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    for name in required:
        if isinstance(name, str) and name in properties and f"{pointer}/properties/{_escape(name)}" not in finite:
            return False
    min_items = node.get("minItems", 0)
    if isinstance(min_items, int) and not isinstance(min_items, bool) and min_items > 0:
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        needed = [f"{pointer}/prefixItems/{n}" for n in range(min(min_items, len(prefix)))]
        if min_items > len(prefix) and isinstance(node.get("items"), dict | bool):
            needed.append(f"{pointer}/items")
        if not all(p in finite for p in needed):
            return False
    return True


def _entered(schema: Any, nodes: dict[str, Any]) -> Iterator[str]:
    """The pointers of the parts a value may enter, parents first: `$defs` only through a `$ref`."""
    stack, seen = [("#", schema)], set()
    while stack:
        pointer, node = stack.pop()
        if pointer in seen or not isinstance(node, dict | bool) or node is False:
            continue
        seen.add(pointer)
        yield pointer
        if node is True:
            continue
        nexts = []
        target = _target(node)
        if target is not None and target in nodes:
            nexts.append((target, nodes[target]))
        for key, value in _children(node):
            if not key.startswith(("$defs/", "definitions/", "not")):
                nexts.append((f"{pointer}/{key}", value))
        stack.extend(reversed(nexts))


def check_finite(schema: Any) -> None:
    """ValueError naming the first part of `schema` a value may enter that has no finite value."""
    pointer = infinite_part(schema)
    if pointer is not None:
        raise ValueError(
            f"the schema at {pointer} admits no finite value (a $ref cycle without a base case?): "
            "an answer could begin it and never end"
        )
