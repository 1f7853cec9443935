"""Whether a JSON schema's parts all have a finite value, before llguidance runs it.

llguidance lets a model begin any property a schema declares: it writes the key, then finds the
value's grammar. A part with no finite value compiles and masks its first tokens, and then the
answer cannot end: after the key of a `$ref` cycle without a base case (`{"$defs": {"a": {"$ref":
"#/$defs/a"}}}`) no token continues it (a dead end mid-answer), and an object that requires
itself nests until max_tokens. Such a schema is refused up front, naming the part. The rule is
knowingly stricter than what can go wrong: an `anyOf` member without a finite value is refused
too, though llguidance never enters one that cannot write a first token.
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
    finite = _finite_parts(nodes)
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


def _conditions(pointer: str, node: dict, nodes: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """What `node` needs to have a finite value: parts that must all have one (its `$ref`, every
    `allOf` member, its required properties, its first minItems items) and groups of which one
    member must (`anyOf`, `oneOf`). A part that is no schema here is not ours to judge."""
    every: list[str] = []
    target = _target(node)
    if target is not None:
        every.append(target)
    lists = {key: node[key] for key in ("allOf", "anyOf", "oneOf", "prefixItems") if isinstance(node.get(key), list)}
    every += [f"{pointer}/allOf/{n}" for n in range(len(lists.get("allOf", [])))]
    properties, required = node.get("properties"), node.get("required")
    properties = properties if isinstance(properties, dict) else {}
    required = required if isinstance(required, list) else []
    every += [f"{pointer}/properties/{_escape(n)}" for n in required if isinstance(n, str) and n in properties]
    min_items = node.get("minItems", 0)
    if isinstance(min_items, int) and not isinstance(min_items, bool) and min_items > 0:
        prefix = lists.get("prefixItems", [])
        every += [f"{pointer}/prefixItems/{n}" for n in range(min(min_items, len(prefix)))]
        if min_items > len(prefix):
            every.append(f"{pointer}/items")
    groups = [[f"{pointer}/{key}/{n}" for n in range(len(lists[key]))] for key in ("anyOf", "oneOf") if key in lists]
    return [p for p in every if p in nodes], [[p for p in g if p in nodes] for g in groups]


def _finite_parts(nodes: dict[str, Any]) -> set[str]:
    """The parts that have a finite value: the least fixpoint of their conditions, each part's
    unmet conditions counted down as the parts they wait on turn finite (linear in the schema)."""
    unmet: dict[str, int] = {}
    waiting: dict[str, list[tuple[str, int]]] = {}  # part -> (node, group index or -1 for "every")
    for pointer, node in nodes.items():
        if isinstance(node, bool):
            unmet[pointer] = 0 if node else 1  # `false` admits nothing; a value never enters it
            continue
        every, groups = _conditions(pointer, node, nodes)
        unmet[pointer] = len(every) + len(groups)
        for part in every:
            waiting.setdefault(part, []).append((pointer, -1))
        for g, members in enumerate(groups):
            for part in members:
                waiting.setdefault(part, []).append((pointer, g))
    finite = {pointer for pointer, n in unmet.items() if n == 0}
    work, met_groups = list(finite), set()
    while work:
        for pointer, group in waiting.get(work.pop(), ()):
            if pointer in finite or (pointer, group) in met_groups:
                continue
            if group >= 0:  # one member is enough
                met_groups.add((pointer, group))
            unmet[pointer] -= 1
            if unmet[pointer] == 0:
                finite.add(pointer)
                work.append(pointer)
    return finite


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
