#!/usr/bin/env bash
# Runs tests/c/kernel_check.c: natively (every kernel family this CPU runs against a float64
# reference and the scalar kernels; those it cannot run are skipped, saying so), then, where
# an AArch64 cross-compiler and qemu are available, the NEON kernels under emulation.
# With --install it first installs them from Debian's packages when missing (CI does).
# With RMSNORM_OBJS=DIR (CI: build/temp.*/src after the build) the native check links the
# extension's own objects, DIR/dispatch.o and DIR/kernels/*.o, instead of compiling the kernel
# files again. Otherwise every file compiles in a process of its own.
set -euo pipefail
cd "$(dirname "$0")/../.."
cflags="-O2 -std=gnu11 -ffp-contract=off -Wall -Wextra -Werror -Isrc"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

# compile CC DIR DEFS SOURCE...: one process per source, all at once; objects appended to objs.
compile() {
    local cc=$1 dir=$2 defs=$3 pids=() s o p
    shift 3
    mkdir -p "$dir"
    for s in "$@"; do
        o="$dir/$(basename "$s" .c).o"
        objs+=("$o")
        $cc $cflags $defs -c "$s" -o "$o" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
}

case "$(uname -m)" in
x86_64)
    defs="-DRMSNORM_HAVE_AVX2 -DRMSNORM_HAVE_AVX512 -DRMSNORM_HAVE_AVX512BF16"
    simd="src/kernels/avx2.c src/kernels/avx512.c"
    ;;
aarch64) defs="-DRMSNORM_HAVE_NEON" simd="src/kernels/neon.c" ;;
*) defs="" simd="" ;;
esac
objs=()
if [ -n "${RMSNORM_OBJS:-}" ]; then
    objs=("$RMSNORM_OBJS/dispatch.o" "$RMSNORM_OBJS"/kernels/*.o)
else
    compile gcc "$out/o-native" "$defs" src/dispatch.c src/kernels/scalar.c $simd
fi
gcc $cflags $defs tests/c/kernel_check.c "${objs[@]}" -lm -o "$out/native"
"$out/native"

if [ "$(uname -m)" != aarch64 ]; then
    if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64-static >/dev/null; then
        if [ "${1:-}" = --install ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                gcc-aarch64-linux-gnu qemu-user-static) >/dev/null 2>&1 || true
        fi
    fi
    if command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64-static >/dev/null; then
        objs=()
        compile aarch64-linux-gnu-gcc "$out/o-neon" -DRMSNORM_HAVE_NEON \
            src/dispatch.c src/kernels/scalar.c src/kernels/neon.c
        aarch64-linux-gnu-gcc $cflags -DRMSNORM_HAVE_NEON tests/c/kernel_check.c "${objs[@]}" -lm -static \
            -o "$out/neon"
        qemu-aarch64-static "$out/neon"
    else
        echo "NEON check skipped: no aarch64-linux-gnu-gcc / qemu-aarch64-static"
    fi
fi
