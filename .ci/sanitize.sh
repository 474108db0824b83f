#!/usr/bin/env bash
# Builds the extension with AddressSanitizer + UndefinedBehaviorSanitizer in a scratch copy of
# the tree and runs the test suite against it (gcc's libasan preloaded into Python).
# -g1 (line tables, no variable locations) and -fno-tree-pta: with full debug information and
# points-to analysis, gcc 12 took over half an hour on avx512.c's instrumented kernels (the
# points-to analysis alone 42% of avx512bf16.c's 171 s); with neither, 211 s and 70 s. Neither
# changes what the sanitizers check. In the kernel files alone, three of UBSan's checks are off:
# pointer-overflow (an address wrapping around), object-size (accesses past an object of known
# size) and null (a null dereference); ASan reports such an access, or the fault, itself. They
# made up over half of the kernels' instrumented build time (the float64 scalar kernels: 27 s ->
# 15 s).
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp -r "$src/src" "$src/rmsnorm" "$src/tests" "$src/setup.py" "$src/pyproject.toml" "$src/README.md" "$work/"
rm -f "$work"/rmsnorm/*.so
cd "$work"
# On x86 Linux, only the SIMD files this CPU runs (RMSNORM_ISAS): the others would be built and
# never called, and each AVX-512 file takes minutes to build instrumented.
if cpu="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)"; then
    has() { for f in "$@"; do [[ "$cpu " == *" $f "* ]] || return 1; done; }
    isas="scalar"
    if has avx2 fma f16c; then isas+=",avx2"; fi
    if has avx512f avx512bw avx512vl avx512dq fma f16c; then isas+=",avx512"; fi
    if has avx512_bf16; then isas+=",avx512bf16"; fi
    export RMSNORM_ISAS="$isas"
fi
RMSNORM_WERROR=1 \
RMSNORM_EXTRA_CFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -O1 -g1 -fno-tree-pta" \
RMSNORM_KERNEL_CFLAGS="-fno-sanitize=pointer-overflow,object-size,null" \
RMSNORM_EXTRA_LDFLAGS="-fsanitize=address,undefined" \
    python setup.py -q build_ext --inplace >/dev/null
asan="$(gcc -print-file-name=libasan.so)"
ubsan="$(gcc -print-file-name=libubsan.so)"
# Python itself is not built with ASan: leak checking at exit would report the interpreter.
# The RSS-growth test is left out: ASan's quarantine keeps freed memory on purpose. The adapters
# are left out too: the frameworks' own libraries are not built for a preloaded sanitizer.
LD_PRELOAD="$asan:$ubsan" \
ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1" \
UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
PYTHONPATH="$work" \
    python -m pytest -q -p no:cacheprovider -m "not slow" -k "not torch and not jax and not rss_growth" tests
