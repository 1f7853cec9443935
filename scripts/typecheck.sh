#!/usr/bin/env bash
# mypy over CDE as it installs: the folders gateway/, worker/, shared/ and kernels/ are the
# packages cde.gateway, ... (pyproject.toml's package-dir), which mypy cannot map by itself (it
# reads neither package-dir nor cde/__init__.py's __path__ extension). So this lays that layout out
# as links under .cache/typecheck/cde (scripts/link_tree.sh), checks the package `cde` there, and
# prints the findings under the repository's own paths.
# Configuration: [tool.mypy] in pyproject.toml. Extra arguments go to mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=.cache/typecheck
scripts/link_tree.sh
MYPYPATH="$tree" mypy "$@" -p cde 2>&1 |
    sed -E "s#^$tree/cde/(gateway|worker|shared|kernels)/#\\1/#; s#^$tree/cde/#cde/#"
