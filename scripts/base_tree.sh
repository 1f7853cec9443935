#!/usr/bin/env bash
# An older commit's tree beside this one, for `BASE_TREE=abbase scripts/gpu_run.sh bench` (one call
# measures both commits, so their ratio does not carry the card's run-to-run spread). abbase*/ is in
# .gitignore: name it in the device call's `carry` (with .whl).
# Usage: scripts/base_tree.sh COMMIT [DIR]   (DIR defaults to abbase; another must start with abbase)
set -euo pipefail
COMMIT=${1:?usage: scripts/base_tree.sh COMMIT [DIR]}
DIR=${2:-abbase}
[[ $DIR == abbase* ]] || { echo "DIR must start with abbase (.gitignore keeps those out of git)" >&2; exit 2; }
rm -rf "$DIR" && mkdir -p "$DIR"
git archive "$COMMIT" | tar -x -C "$DIR"
echo "$DIR: $(git rev-parse --short "$COMMIT")"
