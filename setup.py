"""Build the rmsnorm C extension.

Portable baseline flags only (never -march=native). The compiler is probed for OpenMP and for
each ISA family; the SIMD kernel files switch their target on with a pragma, so a family the
compiler cannot target is simply left out and the build falls back to what it can do.
Set RMSNORM_WERROR=1 to turn warnings into errors (CI does). RMSNORM_ISAS (a comma list of avx2,
avx512, avx512bf16, neon) compiles only those families' files, of those the compiler can target:
the sanitizer build (.ci/sanitize.sh) leaves out the families its CPU cannot run.
RMSNORM_EXTRA_CFLAGS / RMSNORM_EXTRA_LDFLAGS add flags to every file / the link, and
RMSNORM_KERNEL_CFLAGS to the kernel files (src/kernels) alone.
"""

import concurrent.futures
import glob
import os
import platform
import tempfile

import numpy as np
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNELS = "src/kernels"
BASE_SOURCES = [
    "src/module.c",
    "src/dispatch.c",
    "src/driver.c",
    f"{KERNELS}/scalar.c",
    f"{KERNELS}/reference.c",
]

PROBES = {
    "avx2": (
        '#pragma GCC target("avx2,fma,f16c")\n#include <immintrin.h>\n'
        "int f(float *p){__m256 v=_mm256_fmadd_ps(_mm256_loadu_ps(p),_mm256_loadu_ps(p),"
        "_mm256_cvtph_ps(_mm_setzero_si128()));_mm256_storeu_ps(p,v);return 0;}\n"
    ),
    "avx512": (
        '#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")\n'
        "#include <immintrin.h>\n"
        "int f(float *p){__m512 v=_mm512_loadu_ps(p);"
        "_mm256_storeu_si256((__m256i*)p,_mm512_cvtepi32_epi16(_mm512_castps_si512(v)));"
        "return (int)_mm512_reduce_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v)));}\n"
    ),
    "avx512bf16": (
        '#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")\n'
        "#include <immintrin.h>\n"
        "__m256bh f(__m512 v){return _mm512_cvtneps_pbh(v);}\n"
    ),
    "neon": "#include <arm_neon.h>\nint f(float *p){vst1q_f32(p, vld1q_f32(p)); return 0;}\n",
    "openmp": "#include <omp.h>\nint f(void){return omp_get_max_threads();}\n",
}


def compiles(compiler, code, extra=()):
    """True when `code` compiles (not links) with the given extra flags."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.c")
        with open(path, "w") as f:
            f.write(code)
        try:
            compiler.compile([path], output_dir=tmp, extra_postargs=list(extra))
        except Exception:
            return False
    return True


class BuildExt(build_ext):
    def build_extensions(self):
        cc = self.compiler
        machine = platform.machine().lower()
        x86 = machine in ("x86_64", "amd64", "i686", "i386")
        arm64 = machine in ("aarch64", "arm64")
        # -g0: the kernels are instantiated per dtype x ISA x option set, and their debug
        # information would be over ten times the code (RMSNORM_EXTRA_CFLAGS=-g brings it back).
        # -ffp-contract=off: no multiply and add fused unless the code asks (V_FMA), so that every
        # path through the kernels rounds the same way whatever the compiler chooses to fuse.
        flags = [
            "-O3", "-g0", "-std=gnu11", "-ffp-contract=off", "-Wall", "-Wextra",
            "-fno-strict-aliasing",
        ]
        if os.environ.get("RMSNORM_WERROR") == "1":
            flags.append("-Werror")
        flags += os.environ.get("RMSNORM_EXTRA_CFLAGS", "").split()
        sources, macros, link = [], [], []
        only = os.environ.get("RMSNORM_ISAS")

        def wanted(isa, arch):
            return arch and (only is None or isa in only.split(",")) and compiles(cc, PROBES[isa])

        if wanted("avx2", x86):
            sources.append(f"{KERNELS}/avx2.c")
            macros.append(("RMSNORM_HAVE_AVX2", "1"))
        if wanted("avx512", x86):
            sources.append(f"{KERNELS}/avx512.c")
            macros.append(("RMSNORM_HAVE_AVX512", "1"))
            # the bfloat16 kernels of CPUs with AVX512-BF16, in the same file
            if wanted("avx512bf16", x86):
                macros.append(("RMSNORM_HAVE_AVX512BF16", "1"))
        if os.path.exists(f"{KERNELS}/neon.c") and wanted("neon", arm64):
            sources.append(f"{KERNELS}/neon.c")
            macros.append(("RMSNORM_HAVE_NEON", "1"))
        if os.environ.get("RMSNORM_NO_OPENMP") != "1" and compiles(
            cc, PROBES["openmp"], ["-fopenmp"]
        ):
            flags.append("-fopenmp")
            link.append("-fopenmp")
        for ext in self.extensions:
            ext.sources = BASE_SOURCES + sources
            ext.define_macros += macros
            ext.extra_compile_args = flags
            ext.extra_link_args = link + os.environ.get("RMSNORM_EXTRA_LDFLAGS", "").split()
        super().build_extensions()

    def build_extension(self, ext):
        # The kernel files take minutes each to compile (one instantiation per dtype x ISA x option
        # set), and distutils compiles the sources of an extension one after another: compile them
        # on as many CPUs as there are, then let distutils link what it finds. The kernel files
        # alone also take RMSNORM_KERNEL_CFLAGS (the sanitizer build's lighter checks there).
        jobs = min(len(ext.sources), os.cpu_count() or 1)
        kernel_flags = os.environ.get("RMSNORM_KERNEL_CFLAGS", "").split()
        # No loop unswitching in the kernels: it copied each row sum's loop for the first pass's
        # prefetch test (a pointer known at run time), 4% of the kernels' text for no measured
        # speed. No errno from sqrt, which nothing reads: then a block of short rows takes its
        # square roots in vector instructions, and no scalar sqrt keeps a libm call beside it
        # (benchmarks/NOTES.md).
        for flag in ("-fno-unswitch-loops", "-fno-math-errno"):
            if compiles(self.compiler, "int f(void){return 0;}\n", [flag, "-Werror"]):
                kernel_flags = [flag] + kernel_flags
        if not hasattr(self.compiler, "_rms_serial_compile"):
            serial = self.compiler.compile
            self.compiler._rms_serial_compile = serial

            def compile_one(src, args, kwargs):
                extra = list(kwargs.get("extra_postargs") or [])
                if kernel_flags and src.startswith(KERNELS + "/"):
                    extra += kernel_flags
                if src == f"{KERNELS}/scalar.c":
                    # the fallback of CPUs without SIMD: optimized for size (the same bits;
                    # its unrolled row loops were a third of the extension)
                    extra.append("-Os")
                kwargs = dict(kwargs, extra_postargs=extra)
                return serial([src], *args, **kwargs)

            def compile_parallel(sources, *args, **kwargs):
                with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
                    parts = pool.map(lambda src: compile_one(src, args, kwargs), sources)
                    return [obj for objs in parts for obj in objs]

            self.compiler.compile = compile_parallel
        super().build_extension(ext)

    def run(self):
        super().run()
        if not self.inplace:
            # Also drop the built module into the source tree, so that `python -m rmsnorm` run
            # from a checkout (where the checkout's rmsnorm/ shadows the installed one) works.
            try:
                self.copy_extensions_to_source()
            except OSError:
                pass


setup(
    ext_modules=[
        Extension(
            "rmsnorm._core",
            sources=BASE_SOURCES,
            include_dirs=[np.get_include(), "src"],
            depends=sorted(glob.glob("src/**/*.h", recursive=True)),
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
