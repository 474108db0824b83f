"""`python -m rmsnorm`: print the build and runtime configuration, then check every kernel
family against a float64 NumPy reference and show a short demo with timings."""

import os
import sys
import time

import ml_dtypes
import numpy as np

import rmsnorm
from rmsnorm import _core

DTYPES = {
    "float32": np.float32,
    "float64": np.float64,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
}
# Largest error allowed against the float64 reference, relative to the row's largest |y|:
# a few units in the last place of each format (the result is rounded once to it).
TOLERANCE = {"float32": 4e-6, "float64": 1e-13, "float16": 2e-3, "bfloat16": 1.6e-2}


def reference(x, gamma, eps):
    """float64 RMSNorm: the oracle every kernel is checked against."""
    x64 = x.astype(np.float64)
    rstd = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return x64 * rstd * gamma.astype(np.float64)


def reference_backward(dy, x, gamma, eps):
    x64, dy64, w = x.astype(np.float64), dy.astype(np.float64), gamma.astype(np.float64)
    rstd = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    xhat, g = x64 * rstd, dy64 * w
    dx = rstd * (g - xhat * np.mean(g * xhat, axis=-1, keepdims=True))
    return dx, (dy64 * xhat).sum(axis=0)


def worst(a, ref):
    scale = np.maximum(np.abs(ref).max(axis=-1, keepdims=True), 1e-30)
    return float((np.abs(a.astype(np.float64) - ref) / scale).max())


def self_check():
    """Every ISA x dtype x thread count against the reference; returns the number of failures."""
    rng = np.random.default_rng(0)
    failures = 0
    isa0, threads0 = rmsnorm.isa(), rmsnorm.get_num_threads()
    print(f"{'isa':8} {'dtype':9} {'threads':>7} {'fwd err':>9} {'bwd err':>9}  result")
    for isa in rmsnorm.available_isas():
        for name, dt in DTYPES.items():
            for threads in sorted({1, threads0}):
                rmsnorm.set_isa(isa)
                rmsnorm.set_num_threads(threads)
                x = rng.standard_normal((67, 1031)).astype(dt)
                dy = rng.standard_normal((67, 1031)).astype(dt)
                gamma = rng.standard_normal(1031).astype(np.float32)
                y, rstd = rmsnorm.rms_norm(x, gamma, 1e-6)
                dx, _ = rmsnorm.rms_norm_backward(dy, x, gamma, rstd)
                e_fwd = worst(y, reference(x, gamma, 1e-6))
                e_bwd = worst(dx, reference_backward(dy, x, gamma, 1e-6)[0])
                ok = e_fwd <= TOLERANCE[name] and e_bwd <= 4 * TOLERANCE[name]
                failures += not ok
                print(
                    f"{isa:8} {name:9} {threads:7d} {e_fwd:9.2e} {e_bwd:9.2e}  "
                    f"{'ok' if ok else 'FAIL'}"
                )
    rmsnorm.set_isa(isa0)
    rmsnorm.set_num_threads(threads0)
    return failures


def median_time(fn, repeats=9):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def demo():
    """One LLM-sized call, against hand-written NumPy and a copy of the same bytes."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2048, 4096)).astype(np.float32)
    gamma = rng.standard_normal(4096).astype(np.float32)
    y = np.empty_like(x)
    dst = np.empty_like(x)

    def numpy_rms_norm():
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * gamma

    t_ours = median_time(lambda: rmsnorm.rms_norm(x, gamma, out=y))
    t_numpy = median_time(numpy_rms_norm)
    # the faster of a plain copy and one that prefetches ahead (faster on some CPUs)
    t_copy = min(median_time(lambda: _core.copy(x, dst, pf)) for pf in (False, True))
    err = worst(y, reference(x, gamma, 1e-6))
    print(f"\ndemo: rms_norm of float32 {x.shape} with {rmsnorm.get_num_threads()} threads")
    print(f"  max error vs float64 NumPy: {err:.1e} (relative to each row's max |y|)")
    print(f"  rmsnorm {t_ours * 1e3:.2f} ms | NumPy {t_numpy * 1e3:.2f} ms "
          f"({t_numpy / t_ours:.1f}x slower) | copy of the same bytes {t_copy * 1e3:.2f} ms "
          f"(rmsnorm = {t_ours / t_copy:.2f}x copy)")


def main():
    print(f"rmsnorm {rmsnorm.__version__}, NumPy {np.__version__}, Python {sys.version.split()[0]}")
    print(f"isa: {rmsnorm.isa()} (available: {', '.join(rmsnorm.available_isas())})")
    openmp = "yes" if _core.have_openmp() else "no"
    print(f"threads: {rmsnorm.get_num_threads()} (OpenMP: {openmp})")
    stream, l3 = _core.stream_bytes()
    l3_text = ("set by RMSNORM_STREAM_BYTES" if os.environ.get("RMSNORM_STREAM_BYTES")
               else f"half the {l3 / 2**20:g} MiB L3, at most 32 MiB" if l3
               else "L3 size unknown")
    print(f"streaming stores: outputs of {stream / 2**20:g} MiB or more ({l3_text})\n")
    failures = self_check()
    demo()
    print(f"\nself-check: {'all passed' if not failures else f'{failures} FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
