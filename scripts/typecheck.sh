#!/usr/bin/env bash
# mypy over CDE as it installs: the folders gateway/, worker/, shared/ and kernels/ are the
# packages cde.gateway, ... (pyproject.toml's package-dir), which mypy cannot map by itself (it
# reads neither package-dir nor cde/__init__.py's __path__ extension). So this lays that layout out
# as links under .cache/typecheck/cde (each entry of cde/, plus gateway -> ../../../gateway, ...),
# checks the package `cde` there, and prints the findings under the repository's own paths.
# Configuration: [tool.mypy] in pyproject.toml. Extra arguments go to mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
tree=.cache/typecheck
rm -rf "$tree"
mkdir -p "$tree/cde"
for entry in cde/*; do
    case "$(basename "$entry")" in __pycache__ | *.egg-info) continue ;; esac
    ln -s "$root/$entry" "$tree/cde/"
done
for pkg in gateway worker shared kernels; do
    ln -s "$root/$pkg" "$tree/cde/$pkg"
done
MYPYPATH="$tree" mypy "$@" -p cde 2>&1 |
    sed -E "s#^$tree/cde/(gateway|worker|shared|kernels)/#\\1/#; s#^$tree/cde/#cde/#"
