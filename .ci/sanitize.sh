#!/usr/bin/env bash
# Runs the test suite against an AddressSanitizer + UndefinedBehaviorSanitizer build of the
# extension (asan_build.sh), gcc's libasan preloaded into Python.
set -euo pipefail
ci="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
bash "$ci/asan_build.sh" "$work/tree"
cd "$work/tree"
asan="$(gcc -print-file-name=libasan.so)"
ubsan="$(gcc -print-file-name=libubsan.so)"
# Python itself is not built with ASan: leak checking at exit would report the interpreter.
# The RSS-growth test is left out: ASan's quarantine keeps freed memory on purpose. The adapters
# are left out too: the frameworks' own libraries are not built for a preloaded sanitizer.
LD_PRELOAD="$asan:$ubsan" \
ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1" \
UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
PYTHONPATH="$work/tree" \
    python -m pytest -q -p no:cacheprovider -m "not slow" -k "not torch and not jax and not rss_growth" tests
