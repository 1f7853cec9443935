#!/usr/bin/env bash
# Compile caches that outlive a device machine. Every call that does not follow the last within 30 s
# starts a fresh machine, whose cold 8b start compiles for 2-3.5 minutes a precision (on the H100:
# 203 s bfloat16, 133 s fp8): most of a call. `gpu_run.sh` unpacks the card's archive from
# .gpu-cache/ (carried; .gitignore keeps it out of git) under CDE_HOME before its stages and, with
# CACHE_OUT=1, packs CDE_HOME's compile caches back to $OUT for the next call to carry.
# Inductor and Triton key every entry by the graph or source, torch and the card, and CDE's
# inductor directory by its kernels' sources (cde/shared/home.py): a stale entry is a miss, never a
# wrong kernel. The GEMM launch configs a start times (gemm-tuning/) are not packed: each call
# times its own, as a cold start does, so a bench's picks stay comparable with earlier runs.
# Usage: scripts/gpu_compile_cache.sh unpack CDE_HOME CARD | pack CDE_HOME CARD OUT
set -euo pipefail
ACTION=${1:?usage: gpu_compile_cache.sh unpack|pack CDE_HOME CARD [OUT]}
HOME_DIR=${2:?CDE_HOME}
CARD=${3:?card name}
NAME="compile-cache-$(tr -c 'A-Za-z0-9\n' '_' <<< "$CARD").tgz"  # the device tool brings back plain names only
LIMIT=$((16 * 1024 * 1024))  # the device tool brings back no file over 16 MiB
case $ACTION in
  unpack)
    ARCHIVE=.gpu-cache/$NAME
    if [[ ! -f $ARCHIVE ]]; then
      echo "compile caches: none carried for $CARD (.gpu-cache/$NAME)"
    elif [[ -d $HOME_DIR/compile-cache ]]; then
      echo "compile caches: this machine's own kept (a warm machine)"
    else
      mkdir -p "$HOME_DIR" && tar xzf "$ARCHIVE" -C "$HOME_DIR"
      echo "compile caches: unpacked $ARCHIVE ($(du -sh "$HOME_DIR/compile-cache" | cut -f1))"
    fi ;;
  pack)
    OUT=${4:?OUT}
    [[ -d $HOME_DIR/compile-cache ]] || { echo "compile caches: none under $HOME_DIR"; exit 0; }
    tar czf "$OUT/$NAME" -C "$HOME_DIR" compile-cache
    SIZE=$(stat -c %s "$OUT/$NAME")
    if (( SIZE > LIMIT )); then
      rm "$OUT/$NAME"
      echo "compile caches: $SIZE bytes packed, over the 16 MiB a file the device tool brings back; not kept"
    else
      echo "compile caches: $NAME, $SIZE bytes, packed for \$OUT; copy it to .gpu-cache/ and carry .gpu-cache"
    fi ;;
  *) echo "unknown action $ACTION" >&2; exit 2 ;;
esac
