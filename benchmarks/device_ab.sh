#!/usr/bin/env bash
# Builds the kernels of a base commit beside this checkout's and times the two builds against
# each other with benchmarks/ab.py, on a many-core machine with no network:
#
#   OUT=/tmp/ab benchmarks/device_ab.sh [BASE]        (BASE: a commit, default 844ab66)
#
# Needs python3 with numpy, ml_dtypes and setuptools, and a C compiler with OpenMP.
# The base's sources come from $OLD_SRC (a folder or a tar file of them; where the machine has
# no copy of the repository's history, make one beside it with `git archive -o FILE BASE`), else
# from `git archive BASE` of this checkout. $OLD_SO (an already built _core*.so of the base) skips
# that build. The base and this checkout build at the same time, each compiling its files in
# parallel (setup.py); this checkout's is in place (setuptools skips it when build/ is current).
# Then ab.py runs at threads $THREADS (default 1,4,16) with $REPS interleaved rounds per cell
# (default 5: the whole run stays within about 8 minutes on 16 cores); $AB_ARGS adds options
# (e.g. "--quick" or "--only bwd,bf16"). The report goes to $OUT/ab.md and $OUT/ab.csv (rows
# also to $OUT/ab-log.md as they come), the build logs to $OUT/build-old.log and
# $OUT/build-new.log. Exits 1 when a cell's outputs differ.
set -euo pipefail

: "${OUT:?set OUT to the folder for the report}"
BASE=${1:-844ab66}
THREADS=${THREADS:-1,4,16}
REPS=${REPS:-5}
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/rms_device_ab.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT" "$WORK/old" "$WORK/aside"

build() { # folder, log
    (cd "$1" && "$PY" setup.py build_ext --inplace) >"$2" 2>&1 || {
        echo "error: the build in $1 failed; the end of $2:" >&2
        tail -n 30 "$2" >&2
        return 1
    }
}

start=$SECONDS
if [ -z "${OLD_SO:-}" ]; then
    if [ -n "${OLD_SRC:-}" ] && [ -d "$OLD_SRC" ]; then
        cp -a "$OLD_SRC"/. "$WORK/old"
    elif [ -n "${OLD_SRC:-}" ]; then
        tar -xf "$OLD_SRC" -C "$WORK/old"
    else
        git -C "$HERE" archive "$BASE" | tar -x -C "$WORK/old"
    fi
    rm -rf "$WORK/old/build" "$WORK"/old/rmsnorm/_core*.so
    build "$WORK/old" "$OUT/build-old.log" &
    old_build=$!
fi
build "$HERE" "$OUT/build-new.log"
[ -z "${OLD_SO:-}" ] && wait "$old_build"
echo "# builds done in $((SECONDS - start)) s" >&2

if [ -z "${OLD_SO:-}" ]; then
    built=("$WORK"/old/rmsnorm/_core*.so)
    OLD_SO=${built[0]}
fi
# Aside, so that nothing about the base's checkout (its rmsnorm package) is on any path.
cp "$OLD_SO" "$WORK/aside/"
old_copy="$WORK/aside/$(basename "$OLD_SO")"

# Rows stream to $OUT/ab-log.md as they come, so a run cut short still leaves what it measured.
# shellcheck disable=SC2086 # AB_ARGS is a list of options
PYTHONUNBUFFERED=1 "$PY" "$HERE/benchmarks/ab.py" --old "$old_copy" --threads "$THREADS" \
    --reps "$REPS" --out "$OUT/ab.md" --csv "$OUT/ab.csv" ${AB_ARGS:-} |
    tee "$OUT/ab-log.md" || status=$?
echo "# total $((SECONDS - start)) s" >&2
exit "${status:-0}"
