"""One definition per rule: the numbers of shared/limits.py (and the block size, shared/config.py's
PAGE) are written out nowhere else in CDE's code, so that a rule changed there changes everywhere.

Three checks over the installed packages' sources (cde/, gateway/, worker/, shared/, kernels/),
reading code only (comments and strings are prose):
- the block and bound numbers 64, 128 and 256 appear only where listed below, each listing a
  different quantity that happens to share the value; a new copy fails with its place;
- the request schemas' bounds (`le=`, `max_length=`, ...) are names from shared/limits.py, never
  numbers (0 and 1 aside);
- no module re-exports a constant under a second name (`DEFAULT_X = X`), and no module other than
  shared/limits.py defines a name that shared/limits.py defines.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cde", "gateway", "worker", "shared", "kernels")
LIMITS = "shared/limits.py"
WATCHED = (64, 128, 256)

# Where a watched number may stand in code, at most how often, and what it is there. Anything
# else is a rule or the block size: import it (shared/limits.py, shared/config.py's PAGE).
ALLOWED: dict[str, dict[int, int]] = {
    "shared/config.py": {64: 3, 128: 2, 256: 3},  # PAGE itself; the presets' model shapes
    "cde/commands/bench_engine.py": {256: 1},  # --max-tokens' default
    "cde/commands/bench_prefix_cache.py": {64: 1, 256: 1},  # --tail-tokens' and --max-tokens' defaults
    "cde/commands/bench_prefix_routing.py": {64: 1},  # --requests' default
    "cde/commands/bench_serve.py": {64: 1},  # --max-tokens' default
    "cde/commands/eval.py": {64: 1},  # --max-running's default
    "cde/commands/gateway.py": {128: 1, 256: 1},  # --max-queue and --max-queued-per-client defaults
    "cde/commands/generate.py": {64: 1},  # --max-tokens' default
    "cde/commands/load_processes.py": {64: 1},  # random bits of a seed
    "cde/eval/concept_eval.py": {64: 2, 128: 1},  # the eval's max_tokens
    "cde/train/loop.py": {64: 1, 128: 1},  # training options
    "cde/train/program.py": {64: 3, 128: 1, 256: 2},  # training model shapes and options
    "cde/train/token_set.py": {64: 1},  # a vocabulary sample size
    "gateway/errors.py": {128: 1},  # the longest param name an error echoes
    "gateway/prompts.py": {64: 1, 128: 1},  # cl100k_base's longest token; a thread's text, 64 KiB
    "gateway/router.py": {128: 1, 256: 1},  # queue defaults (cde/commands/gateway.py's)
    "kernels/gemm_tiles.py": {64: 2},  # bfloat16 elements of a 128-byte line: one L2 prefetch each
    "kernels/stream_tiles.py": {64: 1, 256: 1},  # the split-K GEMM's row and K tiles
    "shared/catalog_file.py": {64: 1},  # 64 MiB catalog file cap
    "shared/settings.py": {256: 1},  # EngineArgs.max_items' default (64-token blocks per pass)
    "worker/attribution_runner.py": {128: 1},  # attribution row buckets
    "worker/cuda_graphs.py": {64: 2},  # the largest batch bucket; dynamo's cache size
    "worker/demo_model.py": {64: 1},  # 64 MiB unpack slack
    "worker/inbox_budget.py": {64: 1, 256: 1},  # frame byte budgets (MiB)
    "worker/model_runner.py": {128: 1},  # the LM head's row padding on CUDA
}
SCHEMAS = ("gateway/schemas.py", "gateway/chat_schemas.py", "gateway/structured_schemas.py")
BOUND_KEYWORDS = {"le", "lt", "ge", "gt", "max_length", "min_length"}


def sources() -> dict[str, str]:
    return {
        str(p.relative_to(ROOT)): p.read_text()
        for package in PACKAGES
        for p in sorted((ROOT / package).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def watched_numbers(text: str) -> Counter[int]:
    found: Counter[int] = Counter()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NUMBER:
            value = ast.literal_eval(tok.string)
            if isinstance(value, int) and value in WATCHED:
                found[value] += 1
    return found


def test_rule_numbers_appear_only_where_listed():
    copies = []
    for path, text in sources().items():
        if path == LIMITS:
            continue
        allowed = ALLOWED.get(path, {})
        for value, count in watched_numbers(text).items():
            if count > allowed.get(value, 0):
                copies.append(f"{path}: {value} x{count} (allowed {allowed.get(value, 0)})")
    assert not copies, (
        "a rule's number written out again: import it from shared/limits.py (or PAGE from "
        "shared/config.py), or, for a different quantity, list it in ALLOWED with what it is:\n" + "\n".join(copies)
    )


def test_the_allowed_list_names_files_that_exist():
    assert not [path for path in ALLOWED if not (ROOT / path).is_file()]


def _number(node: ast.expr) -> float | None:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _number(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp):  # 1 << 64, 2 * 8: a number written as arithmetic
        left, right = _number(node.left), _number(node.right)
        return None if left is None or right is None else 2.0  # any value outside {0, 1}
    return None


def test_schema_bounds_are_named():
    numbered = []
    for path in SCHEMAS:
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if not isinstance(node, ast.Call):
                continue
            for kw in node.keywords:
                value = _number(kw.value) if kw.arg in BOUND_KEYWORDS else None
                if value is not None and abs(value) not in (0, 1):
                    numbered.append(f"{path}:{kw.value.lineno}: {kw.arg}={ast.unparse(kw.value)}")
    assert not numbered, "a schema bound is a number: name it in shared/limits.py\n" + "\n".join(numbered)


def _constant_names(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level UPPER_CASE assignments: name -> value."""
    out = {}
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            for name in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(name, ast.Name) and name.id.isupper():
                    out[name.id] = node.value
    return out


def _aliased(value: ast.expr) -> str | None:
    """The constant `value` merely names again (X, or module.X), if it does."""
    name = value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else None
    return name if name is not None and name.isupper() else None


def test_no_constant_has_a_second_name_or_a_second_definition():
    all_sources = sources()
    rules = set(_constant_names(ast.parse(all_sources[LIMITS])))
    found = []
    for path, text in all_sources.items():
        for name, value in _constant_names(ast.parse(text)).items():
            if path != LIMITS and name in rules:
                found.append(f"{path}: {name} is shared/limits.py's: import it")
            # A rule may be stated as the quantity that bounds it (MAX_TOKENS_PER_STEP = PAGE).
            aliased = _aliased(value)
            if aliased is not None and path != LIMITS:
                found.append(f"{path}: {name} = {ast.unparse(value)}: use {aliased} itself")
    assert not found, "\n".join(found)
