#!/usr/bin/env bash
# Runs tests/c/kernel_check.c: natively (every x86 ISA this CPU has against scalar), then, where
# an AArch64 cross-compiler and qemu are available, the NEON kernels under emulation.
# With --install it first installs them from Debian's packages when missing (CI does).
set -euo pipefail
cd "$(dirname "$0")/../.."
sources="src/kernels/scalar.c src/dispatch.c tests/c/kernel_check.c"
x86="-DRMSNORM_HAVE_AVX2 -DRMSNORM_HAVE_AVX512 -DRMSNORM_HAVE_AVX512BF16"
x86_src="src/kernels/avx2.c src/kernels/avx512.c src/kernels/avx512bf16.c"
cflags="-O2 -std=gnu11 -ffp-contract=off -Wall -Wextra -Werror -Isrc"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

case "$(uname -m)" in
x86_64) gcc $cflags $x86 $sources $x86_src -lm -o "$out/native" ;;
aarch64) gcc $cflags -DRMSNORM_HAVE_NEON $sources src/kernels/neon.c -lm -o "$out/native" ;;
*) gcc $cflags $sources -lm -o "$out/native" ;;
esac
"$out/native"

if [ "$(uname -m)" != aarch64 ]; then
    if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64-static >/dev/null; then
        if [ "${1:-}" = --install ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                gcc-aarch64-linux-gnu qemu-user-static) >/dev/null 2>&1 || true
        fi
    fi
    if command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64-static >/dev/null; then
        aarch64-linux-gnu-gcc $cflags -DRMSNORM_HAVE_NEON \
            $sources src/kernels/neon.c -lm -static -o "$out/neon"
        qemu-aarch64-static "$out/neon"
    else
        echo "NEON check skipped: no aarch64-linux-gnu-gcc / qemu-aarch64-static"
    fi
fi
