"""Per-call cost of small RMSNorm calls from PyTorch: rmsnorm.torch.RMSNorm against
torch.nn.RMSNorm (forward+backward with autograd, and forward under no_grad), the registered
op through the dispatcher, and the NumPy kernels alone. Medians of interleaved repeats.

    python benchmarks/torch_overhead.py [--shape 1 4096] [--threads 1] [--repeats 15]
"""

import argparse
import platform
import statistics
import time

import numpy as np
import torch

import rmsnorm
import rmsnorm.torch as rt


def per_call_us(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[1, 4096])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rmsnorm.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shape, n = tuple(args.shape), args.shape[-1]

    ours, theirs = rt.RMSNorm(n, dtype=dtype), torch.nn.RMSNorm(n, eps=1e-6, dtype=dtype)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    dy = torch.randn(shape, dtype=dtype)
    xn, wn = rt._torch_ops.to_numpy(x), rt._torch_ops.to_numpy(ours.weight)
    dyn = rt._torch_ops.to_numpy(dy)

    def fwd_bwd(module):
        def run():
            module(x).backward(dy)

        return run

    def no_grad(module):
        def run():
            with torch.no_grad():
                module(x)

        return run

    class Floor(torch.autograd.Function):
        """Does nothing with the same inputs: the autograd engine's own cost."""

        @staticmethod
        def forward(ctx, x, weight):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, dy):
            return dy, dy.sum(0)

    def floor():
        Floor.apply(x, ours.weight).backward(dy)

    def op_fwd_bwd():
        y, _ = torch.ops.rmsnorm.rms_norm.default(x, ours.weight, 1e-6, 0.0, "end")
        y.backward(dy)

    def kernels():
        y, rstd = rmsnorm.rms_norm(xn, wn, 1e-6)
        rmsnorm.rms_norm_backward(dyn, xn, wn, rstd)

    cases = {
        "fwd+bwd rmsnorm.torch.RMSNorm": fwd_bwd(ours),
        "fwd+bwd torch.nn.RMSNorm": fwd_bwd(theirs),
        "fwd+bwd torch.ops.rmsnorm (dispatcher)": op_fwd_bwd,
        "fwd+bwd NumPy kernels alone": kernels,
        "fwd+bwd autograd floor (empty Function)": floor,
        "no_grad fwd rmsnorm.torch.RMSNorm": no_grad(ours),
        "no_grad fwd torch.nn.RMSNorm": no_grad(theirs),
        "fwd inside no_grad rmsnorm.torch.RMSNorm": lambda: ours(x),
        "fwd inside no_grad torch.nn.RMSNorm": lambda: theirs(x),
    }
    inside = {k for k in cases if "inside" in k}
    times = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            # "inside" rows time the call alone, with no_grad entered once outside the loop.
            with torch.no_grad() if name in inside else torch.enable_grad():
                per_call_us(fn, args.calls // 10)
                times[name].append(per_call_us(fn, args.calls))
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"rmsnorm ISA {rmsnorm.isa()}, threads {args.threads}, x {shape} {args.dtype}"
    )
    print(f"{'case':44s} {'median us':>10s} {'min us':>8s}")
    for name, ts in times.items():
        print(f"{name:44s} {statistics.median(ts):10.2f} {min(ts):8.2f}")
    a = statistics.median(times["fwd+bwd torch.nn.RMSNorm"])
    b = statistics.median(times["fwd+bwd rmsnorm.torch.RMSNorm"])
    c = statistics.median(times["no_grad fwd torch.nn.RMSNorm"])
    d = statistics.median(times["no_grad fwd rmsnorm.torch.RMSNorm"])
    print(f"torch / rmsnorm: fwd+bwd {a / b:.2f}x, no_grad fwd {c / d:.2f}x")
    np.testing.assert_allclose(  # the two modules compute the same thing
        ours(x).detach().float().numpy(), theirs(x).detach().float().numpy(), rtol=2e-2, atol=2e-2
    )


if __name__ == "__main__":
    main()
