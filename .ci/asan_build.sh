#!/usr/bin/env bash
# Builds the extension with AddressSanitizer + UndefinedBehaviorSanitizer in a scratch copy of the
# tree: `.ci/asan_build.sh DEST [CFLAGS...]` copies the sources to DEST (which must not exist) and
# builds rmsnorm/_core in place there, with CFLAGS added to every file (the fuzzer's coverage).
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
dest="$1"
shift
mkdir "$dest"
cp -r "$src/src" "$src/rmsnorm" "$src/tests" "$src/setup.py" "$src/pyproject.toml" "$src/README.md" "$dest/"
rm -f "$dest"/rmsnorm/*.so
cd "$dest"
# On x86 Linux, only the SIMD files this CPU runs (RMSNORM_ISAS): the others would be built and
# never called, and each AVX-512 file takes minutes to build instrumented.
if cpu="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)"; then
    has() { for f in "$@"; do [[ "$cpu " == *" $f "* ]] || return 1; done; }
    isas="scalar"
    if has avx2 fma f16c; then isas+=",avx2"; fi
    if has avx512f avx512bw avx512vl avx512dq fma f16c; then isas+=",avx512"; fi
    if has avx512f avx512bw avx512vl avx512dq avx512_bf16; then isas+=",avx512bf16"; fi
    export RMSNORM_ISAS="$isas"
fi
RMSNORM_WERROR=1 \
RMSNORM_EXTRA_CFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -O1 -g1 -fno-tree-pta $*" \
RMSNORM_KERNEL_CFLAGS="-fno-sanitize=pointer-overflow,object-size,null" \
RMSNORM_EXTRA_LDFLAGS="-fsanitize=address,undefined" \
    python setup.py -q build_ext --inplace >/dev/null
