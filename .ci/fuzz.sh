#!/usr/bin/env bash
# Coverage-guided fuzzing of the public functions (tests/fuzz/fuzz_rmsnorm.py, atheris) against
# an AddressSanitizer + UndefinedBehaviorSanitizer build of the extension whose comparisons
# report to libFuzzer (gcc has no libFuzzer edge coverage; -fsanitize-coverage=trace-cmp with
# -use_value_profile=1 gives it features from the C code's comparisons, beside the Python
# coverage of the harness and package).
#   .ci/fuzz.sh [SECONDS] [LIBFUZZER_ARGS...]   (default 60 s)
# RMSNORM_FUZZ_TREE=DIR reuses (or keeps) the instrumented build in DIR; RMSNORM_FUZZ_CORPUS=DIR
# keeps the corpus between runs. A finding leaves its input as crash-* in the current directory
# (libFuzzer's -artifact_prefix) and fails the script.
set -euo pipefail
ci="$(cd "$(dirname "$0")" && pwd)"
src="$(cd "$ci/.." && pwd)"
seconds="${1:-60}"
shift || true
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tree="${RMSNORM_FUZZ_TREE:-$work/tree}"
if [[ ! -f "$tree/rmsnorm/__init__.py" ]] || ! ls "$tree"/rmsnorm/_core*.so >/dev/null 2>&1; then
    rm -rf "$tree"
    bash "$ci/asan_build.sh" "$tree" -fsanitize-coverage=trace-cmp
fi
corpus="${RMSNORM_FUZZ_CORPUS:-$work/corpus}"
mkdir -p "$corpus"
# seeds of every length up to -max_len, the same each run: libFuzzer's own start (empty and
# one-byte inputs, growing slowly) leaves a short run drawing the defaults of every choice
python - "$corpus" <<'PY'
import os, random, sys
rng = random.Random(66)
for i in range(64):
    with open(os.path.join(sys.argv[1], f"seed-{i:02d}"), "wb") as f:
        f.write(bytes(rng.randrange(256) for _ in range(8 * (i + 1))))
PY
asan="$(gcc -print-file-name=libasan.so)"
ubsan="$(gcc -print-file-name=libubsan.so)"
gcc -shared -fPIC -O2 -Wall -Wextra -Werror -o "$work/cov_hooks.so" "$src/tests/fuzz/cov_hooks.c" -ldl
# The hooks ahead of the sanitizer runtimes (see cov_hooks.c), which then cannot come first.
LD_PRELOAD="$work/cov_hooks.so:$asan:$ubsan" \
ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:verify_asan_link_order=0" \
UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
PYTHONPATH="$tree" \
    python "$src/tests/fuzz/fuzz_rmsnorm.py" "$corpus" -max_total_time="$seconds" \
    -use_value_profile=1 -max_len=512 -len_control=0 -timeout=60 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$PWD/" "$@"
