#!/usr/bin/env bash
# The installed layout of CDE as a tree of links, for static tools that cannot follow
# pyproject.toml's package-dir (gateway/ installs as cde.gateway, ...) nor cde/__init__.py's
# __path__ extension: .cache/typecheck/cde holds each entry of cde/ plus gateway, worker, shared
# and kernels, each a link to the repository's own file or folder. mypy (scripts/typecheck.sh)
# checks the package there; pyright and Pylance find it through [tool.pyright] extraPaths, so an
# editor's "go to definition" on cde.worker.engine opens worker/engine.py (by the link's path).
# Run again after adding a file directly under cde/ (files added under the four folders appear
# through their folder's link).
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
