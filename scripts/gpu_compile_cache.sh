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
# The archive is xz-compressed and cut into parts of at most 15 MiB (`NAME.partN`), as the device
# tool brings back no file over 16 MiB: one fp8 start's caches were 24.6 MB as one gzip archive
# (H100, 2026-12-07). At most MAX_PARTS parts, since every part counts against its 8 files.
# Usage: scripts/gpu_compile_cache.sh unpack CDE_HOME CARD | pack CDE_HOME CARD OUT
set -euo pipefail
ACTION=${1:?usage: gpu_compile_cache.sh unpack|pack CDE_HOME CARD [OUT]}
HOME_DIR=${2:?CDE_HOME}
CARD=${3:?card name}
NAME="compile-cache-$(tr -c 'A-Za-z0-9\n' '_' <<< "$CARD").tar.xz"  # the device tool brings back plain names only
PART_BYTES=$((15 * 1024 * 1024))
MAX_PARTS=3
case $ACTION in
  unpack)
    PARTS=(.gpu-cache/"$NAME".part*)
    if [[ ! -f ${PARTS[0]} ]]; then
      echo "compile caches: none carried for $CARD (.gpu-cache/$NAME.part*)"
    elif [[ -d $HOME_DIR/compile-cache ]]; then
      echo "compile caches: this machine's own kept (a warm machine)"
    else
      # the glob sorts part0 .. part2 in order (one digit: at most MAX_PARTS parts)
      mkdir -p "$HOME_DIR" && cat "${PARTS[@]}" | xz -d | tar xf - -C "$HOME_DIR"
      echo "compile caches: unpacked ${#PARTS[@]} part(s) of $NAME ($(du -sh "$HOME_DIR/compile-cache" | cut -f1))"
    fi ;;
  pack)
    OUT=${4:?OUT}
    [[ -d $HOME_DIR/compile-cache ]] || { echo "compile caches: none under $HOME_DIR"; exit 0; }
    ARCHIVE=$(mktemp)
    tar cf - -C "$HOME_DIR" compile-cache | xz -T0 -6 > "$ARCHIVE"
    SIZE=$(stat -c %s "$ARCHIVE")
    if (( SIZE > MAX_PARTS * PART_BYTES )); then
      echo "compile caches: $SIZE bytes packed, more than $MAX_PARTS parts of 15 MiB; not kept"
    else
      split -b "$PART_BYTES" -d -a 1 "$ARCHIVE" "$OUT/$NAME.part"
      echo "compile caches: $NAME, $SIZE bytes in $(ls "$OUT/$NAME".part* | wc -l) part(s), packed for \$OUT;" \
        "copy them to .gpu-cache/ and carry .gpu-cache"
    fi
    rm -f "$ARCHIVE" ;;
  *) echo "unknown action $ACTION" >&2; exit 2 ;;
esac
