# Benchmark suite for rmsnorm: `python -m rmsnorm.bench --help` (or benchmarks/bench.py).
"""Time rmsnorm's kernels against a memory roofline and the peers a user would pick instead.

Every row times our call (fwd, bwd, fused add, or an adapter) interleaved with an in-process
copy of the same bytes (the roofline: ``rmsnorm._core.copy`` / ``triad``) and with the peers:
hand-written float32 NumPy, ``torch.nn.functional.rms_norm`` (CPU), ``jax.jit`` of the plain
``jnp`` formula, ONNX Runtime's SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization
and oneDNN's layer normalization in its RMS mode, each when installed (``pip install
"rmsnorm[peers]"`` brings the last two). The table (or Markdown) goes to stdout, a progress bar to
stderr, and the rows to a CSV and, when matplotlib is installed, a PNG.
"""

from __future__ import annotations

import argparse
import csv
import gc
import importlib
import math
import os
import platform
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

import rmsnorm
from rmsnorm import _core

EPS = 1e-6

# The ROCm TransformerEngine sweep, torch_npu model shapes, decode, and two odd extremes.
TE_SHAPES = [
    (29, 17389),
    (256, 65536),
    (1024, 32768),
    (2048, 16384),
    (4096, 1024),
    (4096, 12288),
    (8192, 2048),
    (8192, 4096),
    (8192, 8192),
    (16384, 4096),
]
NPU_SHAPES = [(1024, 1, 12288), (512, 4, 4096), (4, 2048, 5120), (2, 2048, 4096)]
DECODE_SHAPES = [(1, 4096), (64, 4096)]
ODD_SHAPES = [(1, 1048576), (1000000, 64)]
ALL_SHAPES = TE_SHAPES + NPU_SHAPES + DECODE_SHAPES + ODD_SHAPES
QUICK_SHAPES = [(2048, 4096), (1, 4096)]
# Under --isa auto, every ISA is timed on these shapes (at 1 thread and all cores).
ISA_SUBSET_SHAPES = [(1, 4096), (64, 4096), (8192, 4096)]

DTYPES = {
    "fp32": np.dtype(np.float32),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "fp16": np.dtype(np.float16),
}
CORE_OPS = ("fwd", "bwd", "add")
ADAPTER_OPS = ("torch.fwd", "torch.fwd+bwd", "jax.fwd", "jax.fwd+bwd", "jax.vg")
# Arrays of x's size that each op must read or write once (rstd and gamma are negligible).
ARRAYS_MOVED = {
    "fwd": 2,
    "bwd": 3,
    "add": 4,
    "torch.fwd": 2,
    "torch.fwd+bwd": 5,
    "jax.fwd": 2,
    "jax.fwd+bwd": 5,
    "jax.vg": 5,
}
# The roofline call moving those same bytes: copy = 2 arrays, triad = 3.
ROOFLINE = {
    "fwd": ("copy",),
    "bwd": ("triad",),
    "add": ("copy", "copy"),
    "torch.fwd": ("copy",),
    "torch.fwd+bwd": ("copy", "triad"),
    "jax.fwd": ("copy",),
    "jax.fwd+bwd": ("copy", "triad"),
    "jax.vg": ("copy", "triad"),
}
# Interleaving order of one repetition; "unfused" is np.add followed by rms_norm (op add).
CONTENDERS = ("ours", "copy", "numpy", "torch", "jax", "ort", "onednn", "unfused", "copy_pf")
PEERS = ("numpy", "torch", "jax", "ort", "onednn", "unfused")

SLOW_PEER_S = 2.0  # a peer whose single call takes longer is marked "skip" for the shape
SAMPLE_S = 0.005  # one timing sample loops a call until about this long (small shapes)
REP_BUDGET_S = 8.0  # fewer repetitions when one round of all contenders is slower than this
SMALL_BYTES = 1 << 20  # rows moving fewer bytes also get a timeit-style us/call
MIN_REPS = 3
WARM_AGAIN_S = 0.25  # warm-up calls faster than this are repeated once
# XLA's CPU worker threads keep spinning for some tens of milliseconds after a call returns, and
# whatever runs next on the same cores pays for it (2 cores, float32 8192x4096 backward at 2
# threads: 13.7 ms alone, 33.7 ms right after a jax.jit call, 22.2 ms after a 20 ms pause, 14.4 ms
# after 50 ms). So the next contender starts this long after any call that ran XLA.
XLA_SETTLE_S = 0.1
# Shown in the header: OpenMP's wait policy changes multi-thread timings a lot on small VMs.
OMP_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND", "OMP_NUM_THREADS")


# --------------------------------------------------------------------------- peers


@dataclass
class Peers:
    """Optional modules (None when not installed or not wanted) and why adapters are absent."""

    torch: object = None
    jax: object = None
    ort: object = None  # onnxruntime, with onnx to build its graphs
    onnx: object = None
    onednn: object = None  # rmsnorm._onednn with its library loaded
    torch_adapter: object = None
    jax_adapter: object = None
    notes: list = field(default_factory=list)


def _optional(name: str):
    """Import a module, or return (None, reason) when it is missing or broken."""
    try:
        return importlib.import_module(name), ""
    except Exception as exc:  # noqa: BLE001 - a broken peer must not stop the run
        return None, f"{type(exc).__name__}: {exc}"


def load_peers(
    want_torch: bool, want_jax: bool, want_adapters: bool, want_native: bool = False
) -> Peers:
    """Import torch, jax and our adapters for them, and with want_native ONNX Runtime and
    oneDNN, as requested and available."""
    peers = Peers()
    if want_native:
        _load_native_peers(peers)
    if want_torch:
        peers.torch, why = _optional("torch")
        if peers.torch is None:
            peers.notes.append(f"torch not importable ({why})")
    if want_jax:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no accelerator probing on import
        peers.jax, why = _optional("jax")
        if peers.jax is None:
            peers.notes.append(f"jax not importable ({why})")
    for name in ("torch", "jax"):
        if want_adapters and getattr(peers, name) is not None:
            module, why = _optional(f"rmsnorm.{name}")
            setattr(peers, f"{name}_adapter", module)
            if module is None:
                peers.notes.append(f"rmsnorm.{name} adapter not importable ({why})")
    return peers


def _load_native_peers(peers: Peers) -> None:
    ort, why = _optional("onnxruntime")
    onnx, why_onnx = _optional("onnx") if ort is not None else (None, "")
    if ort is None or onnx is None:
        peers.notes.append(f"ONNX Runtime not timed ({why or why_onnx})")
    else:
        peers.ort, peers.onnx = ort, onnx
    try:
        from rmsnorm import _onednn

        _onednn.load()
    except Exception as exc:  # noqa: BLE001 - a missing peer must not stop the run
        peers.notes.append(f"oneDNN not timed ({type(exc).__name__}: {exc})")
        return
    try:
        _onednn.RMSNorm(1, 16, np.float32, EPS).close()
        peers.onednn = _onednn
    except Exception as exc:  # noqa: BLE001 - as above
        peers.notes.append(
            f"oneDNN not timed: {_onednn.version()} has no RMS mode ({type(exc).__name__}: {exc})"
        )


def _first(result):
    """The y of an adapter that may return (y, rstd)."""
    return result[0] if isinstance(result, (tuple, list)) else result


def numpy_fwd(x, gamma):
    """Hand-written float32 NumPy forward: the reference a NumPy user writes."""
    xf = x.astype(np.float32, copy=False)
    rstd = 1.0 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + EPS)
    return (xf * rstd * gamma.astype(np.float32)).astype(x.dtype, copy=False), rstd


def numpy_bwd(dy, x, gamma, rstd):
    """Hand-written float32 NumPy backward from the saved rstd: returns dx, dgamma."""
    xf = x.astype(np.float32, copy=False)
    dyf = dy.astype(np.float32, copy=False)
    r = rstd.astype(np.float32)[..., None]
    xhat = xf * r
    g = dyf * gamma.astype(np.float32)
    dx = r * (g - xhat * np.mean(g * xhat, axis=-1, keepdims=True))
    dgamma = (dyf * xhat).reshape(-1, x.shape[-1]).sum(axis=0)
    return dx.astype(x.dtype, copy=False), dgamma.astype(gamma.dtype)


def numpy_add(x, residual, gamma):
    """Hand-written float32 NumPy residual add then forward: returns y, rstd, h."""
    h = (x.astype(np.float32) + residual.astype(np.float32)).astype(x.dtype, copy=False)
    return (*numpy_fwd(h, gamma), h)


def torch_view(torch, a: np.ndarray):
    """A torch tensor sharing a's memory (bf16 through its raw 16-bit pattern)."""
    if a.dtype == DTYPES["bf16"]:
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, as taskset sets it), else all."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def jax_formula(jax):
    """The plain jnp RMSNorm a JAX user writes (float32 math, y rounded to x's dtype)."""
    jnp = jax.numpy

    def rms_norm(x, gamma):
        xf = x.astype(jnp.float32)
        rstd = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)
        return (xf * rstd * gamma.astype(jnp.float32)).astype(x.dtype)

    return rms_norm


def jax_loss(jax, forward):
    """sum(y * dy): a scalar whose gradient is the backward pass with upstream dy."""
    jnp = jax.numpy

    def loss(x, gamma, dy):
        return jnp.sum(forward(x, gamma).astype(jnp.float32) * dy.astype(jnp.float32))

    return loss


# ONNX Runtime computes 16-bit rows in float32 (stash_type 1) as ours does; it has no CPU
# kernels for bfloat16 here, nor a backward in its inference package.
ORT_DTYPES = ("fp32", "fp16")


def ort_model(onnx, op: str, dtype: np.dtype, k: int) -> bytes:
    """A one-node ONNX graph over rows of k: SimplifiedLayerNormalization (y, inv_std_var) for
    the forward, com.microsoft SkipSimplifiedLayerNormalization (y, inv_std_var, x + skip) for
    the add, the fused kernels ONNX Runtime's transformer optimizer puts in LLaMA-style graphs."""
    helper, proto = onnx.helper, onnx.TensorProto
    elem = proto.FLOAT16 if dtype == np.float16 else proto.FLOAT
    rows = helper.make_tensor_value_info("x", elem, [None, k])
    inputs = [rows, helper.make_tensor_value_info("g", elem, [k])]
    outputs = [
        helper.make_tensor_value_info("y", elem, [None, k]),
        helper.make_tensor_value_info("inv_std", proto.FLOAT, None),
    ]
    imports = [helper.make_opsetid("", 17)]
    if op == "add":
        inputs.insert(1, helper.make_tensor_value_info("r", elem, [None, k]))
        outputs.append(helper.make_tensor_value_info("h", elem, [None, k]))
        node = helper.make_node(
            "SkipSimplifiedLayerNormalization",
            ["x", "r", "g"],
            ["y", "", "inv_std", "h"],
            domain="com.microsoft",
            epsilon=EPS,
        )
        imports.append(helper.make_opsetid("com.microsoft", 1))
    else:
        node = helper.make_node(
            "SimplifiedLayerNormalization",
            ["x", "g"],
            ["y", "inv_std"],
            axis=-1,
            epsilon=EPS,
            stash_type=1,
        )
    graph = helper.make_graph([node], "rms_norm", inputs, outputs)
    return helper.make_model(graph, opset_imports=imports, ir_version=10).SerializeToString()


class OrtGraph:
    """One ONNX Runtime graph with a session per thread count (a session's intra-op pool is
    fixed when it is made), its pool not spinning between calls, so that its idle threads do
    not take the cores from the next contender. Spinning (its default) measured faster for it
    alone (float32, two threads, Zen 4 VM, in blocks of calls of their own: 64x4096 37.9 rather
    than 47.5 us, 8192x4096 9.22 rather than 9.64 ms), but on the 16-core Xeon at 16 threads it
    slowed every other contender even with a 0.1 s pause after its calls (ours, float32 add of
    64x4096: 81 rather than 1.3 times the roofline)."""

    def __init__(self, ort, model: bytes):
        self.ort, self.model, self.sessions = ort, model, {}

    def session(self):
        """The session for the thread count in use (rmsnorm.set_num_threads)."""
        threads = rmsnorm.get_num_threads()
        if threads not in self.sessions:
            options = self.ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self.sessions[threads] = self.ort.InferenceSession(
                self.model, options, providers=["CPUExecutionProvider"]
            )
        return self.sessions[threads]

    def caller(self, inputs: dict, outputs: dict | None) -> Callable:
        """A call on these NumPy inputs: into the preallocated outputs (IOBinding), or into
        arrays ONNX Runtime allocates when outputs is None."""
        bindings = {}

        def run():
            session = self.session()
            if outputs is None:
                return session.run(None, inputs)
            binding = bindings.get(id(session))
            if binding is None:
                binding = bindings[id(session)] = session.io_binding()
                for name, a in inputs.items():
                    binding.bind_cpu_input(name, a)
                for name, a in outputs.items():
                    binding.bind_output(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
            session.run_with_iobinding(binding)
            return [outputs[name] for name in outputs]

        return run


def ort_call(peers: Peers, op: str, w: "Workload", inputs: dict, alloc: bool, ours_y):
    """ONNX Runtime's call for `op` on the workload's rows, or None where it has none, or
    where its y disagrees with ours (then a note says so)."""
    if peers.ort is None or _dtype_name(w.dtype) not in ORT_DTYPES:
        return None
    m = math.prod(w.shape[:-1])
    rows = {name: a.reshape(m, w.k) if a.ndim > 1 else a for name, a in inputs.items()}
    outputs = None
    if not alloc:
        outputs = {"y": aligned_empty((m, w.k), w.dtype), "inv_std": np.empty((m, 1), np.float32)}
        if op == "add":
            outputs["h"] = aligned_empty((m, w.k), w.dtype)
    try:
        call = OrtGraph(peers.ort, ort_model(peers.onnx, op, w.dtype, w.k)).caller(rows, outputs)
        y = call()[0]
    except Exception as exc:  # noqa: BLE001 - an unsupported case leaves the column empty
        peers.notes.append(f"ONNX Runtime {op} {_dtype_name(w.dtype)}: {_why(exc)}")
        return None
    return call if _agrees(peers, "ONNX Runtime", op, w, y, ours_y) else None


def onednn_call(peers: Peers, op: str, w: "Workload", extra: dict, alloc: bool, ours):
    """oneDNN's layer normalization in RMS mode (forward with its statistic, or backward with
    diff_scale) on the workload's rows, or None where it has none or its output disagrees with
    ours. Its scale, diff_scale and statistic are float32, as its API takes them."""
    if peers.onednn is None:
        return None
    m = math.prod(w.shape[:-1])
    x, gamma = w.x.reshape(m, w.k), w.gamma.astype(np.float32)
    var = np.empty(m, np.float32)
    try:
        prim = peers.onednn.RMSNorm(m, w.k, w.dtype, EPS, backward=op == "bwd")
    except Exception as exc:  # noqa: BLE001 - an unsupported case leaves the column empty
        peers.notes.append(f"oneDNN {op} {_dtype_name(w.dtype)}: {_why(exc)}")
        return None
    out = aligned_empty((m, w.k), w.dtype)

    def fresh():
        return np.empty((m, w.k), w.dtype) if alloc else out

    if op == "fwd":

        def call():
            return prim.forward(x, gamma, fresh(), var)

    else:
        dy, dgamma = extra["dy"].reshape(m, w.k), np.empty(w.k, np.float32)
        prim.forward(x, gamma, aligned_empty((m, w.k), w.dtype), var)

        def call():
            return prim.backward(dy, x, gamma, var, fresh(), dgamma)[0]

    call.primitive = prim  # kept alive with the call
    return call if _agrees(peers, "oneDNN", op, w, call(), ours) else None


def _why(exc: Exception) -> str:
    """An exception as one short line for a note."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


def _dtype_name(dtype: np.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def _agrees(peers: Peers, who: str, op: str, w: "Workload", theirs, ours) -> bool:
    """Whether a peer's output matches ours to a few units in the last place of x's dtype (and
    1e-5, as a peer that sums in float32 rounds more): a check that the two compute the same
    function, so that their times compare."""
    theirs = np.asarray(theirs, np.float64).reshape(-1)
    ours = np.asarray(ours, np.float64).reshape(-1)
    tol = max(8 * float(ml_dtypes.finfo(w.dtype).eps), 1e-5)
    scale = tol * (np.abs(ours) + 1e-3)
    worst = float(np.max(np.abs(theirs - ours) / scale, initial=0.0))
    if not worst <= 1.0:  # NaN too
        peers.notes.append(
            f"{who} {op} {_dtype_name(w.dtype)} left out: its output differs from ours by "
            f"{worst:.3g}x the tolerance"
        )
    return worst <= 1.0


# --------------------------------------------------------------------------- workloads


class Workload:
    """Random inputs of one (shape, dtype), shared by every op, thread count and ISA."""

    def __init__(self, shape: tuple, dtype: np.dtype, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.shape, self.dtype, self.k = shape, dtype, shape[-1]
        self.x = self.random()
        self.gamma = self.rng.uniform(0.5, 1.5, self.k).astype(dtype)

    def random(self) -> np.ndarray:
        """A standard-normal array of the workload's shape and dtype."""
        return self.rng.standard_normal(self.shape, dtype=np.float32).astype(self.dtype)


def aligned_empty(shape, dtype, align: int = 4096) -> np.ndarray:
    """An uninitialised page-aligned array, aligned as rmsnorm's own large outputs are (and as
    the roofline's buffers are, so that neither side gains from alignment)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buf = np.empty(nbytes + align, np.uint8)
    start = (-buf.ctypes.data) % align
    return buf[start : start + nbytes].view(dtype).reshape(shape)


def aligned_empty_like(a: np.ndarray) -> np.ndarray:
    return aligned_empty(a.shape, a.dtype)


def roofline_calls(op: str, nbytes: int) -> dict:
    """The copy/triad calls that move the same bytes as `op` at the current thread count.

    The buffers are their own (float32, x's byte size; filled so no page is touched first in a
    timed call). Reusing our arrays would hand the copy cache lines our call just left dirty.
    "copy" is the plain roofline; where it copies, "copy_pf" is the same calls with the copy
    that prefetches ahead (faster on some CPUs, slower on others): the faster of the two is the
    roofline (time_row).
    """
    count = -(-nbytes // 4)  # 16-bit data: float32 buffers of half the length
    buffers = []
    for _ in range(ARRAYS_MOVED[op]):
        buffers.append(aligned_empty((count,), np.float32))
        buffers[-1].fill(1.0)
    variants = (False, True) if "copy" in ROOFLINE[op] else (False,)
    return {
        "copy_pf" if prefetch else "copy": _roofline_steps(op, buffers, prefetch)
        for prefetch in variants
    }


def _roofline_steps(op: str, buffers: list, prefetch: bool) -> Callable:
    buffers = iter(buffers)
    steps = []
    for kind in ROOFLINE[op]:
        if kind == "copy":
            src, dst = next(buffers), next(buffers)
            steps.append(lambda src=src, dst=dst: _core.copy(src, dst, prefetch))
        else:
            a, b, dst = next(buffers), next(buffers), next(buffers)
            steps.append(lambda a=a, b=b, dst=dst: _core.triad(a, b, dst))
    if len(steps) == 1:
        return steps[0]

    def run_all():
        for step in steps:
            step()

    return run_all


def working_set_mb(op: str, shape: tuple, dtype: np.dtype, with_peers: bool) -> float:
    """Peak memory of one row: our arrays, the roofline's, and the peers' float32 temporaries."""
    size = math.prod(shape)
    nbytes = size * dtype.itemsize
    arrays = ARRAYS_MOVED[op]
    total = 2 * arrays * nbytes  # our inputs and outputs, and the roofline's own buffers
    if with_peers:
        # float32 temporaries of the NumPy/torch formulas, and JAX's copies of the arrays.
        total += 3 * size * 4 + arrays * nbytes
    return total / 2**20


# --------------------------------------------------------------------------- contenders


def build_contenders(op: str, w: Workload, peers: Peers, args) -> dict:
    """Zero-argument callables for every contender of `op` on workload `w`."""
    builders = {
        "fwd": _fwd,
        "bwd": _bwd,
        "add": _add,
        "torch.fwd": _torch_adapter_fwd,
        "torch.fwd+bwd": _torch_adapter_fwd_bwd,
        "jax.fwd": _jax_adapter_fwd,
        "jax.fwd+bwd": _jax_adapter_fwd_bwd,
        "jax.vg": _jax_adapter_vg,
    }
    if args.no_peers and op in CORE_OPS:
        peers = Peers()
    calls = builders[op](w, peers, args.alloc)
    calls.update(roofline_calls(op, w.x.nbytes))
    return {
        name: calls[name]
        for name in CONTENDERS
        if name in calls and not (args.no_peers and name in PEERS)
    }


def _fwd(w: Workload, peers: Peers, alloc: bool) -> dict:
    x, g = w.x, w.gamma
    y = None if alloc else aligned_empty_like(x)
    calls = {"ours": lambda: rmsnorm.rms_norm(x, g, EPS, out=y), "numpy": lambda: numpy_fwd(x, g)}
    if peers.torch is not None:
        torch = peers.torch
        xt, gt = torch_view(torch, x), torch_view(torch, g)
        calls["torch"] = lambda: torch.nn.functional.rms_norm(xt, (w.k,), gt, EPS)
    if peers.jax is not None:
        jax = peers.jax
        f, xj, gj = jax.jit(jax_formula(jax)), jax.numpy.asarray(x), jax.numpy.asarray(g)
        calls["jax"] = lambda: f(xj, gj).block_until_ready()
    if peers.ort is not None or peers.onednn is not None:
        ours_y = rmsnorm.rms_norm(x, g, EPS)[0]
        _add_native(
            calls,
            ort_call(peers, "fwd", w, {"x": x, "g": g}, alloc, ours_y),
            onednn_call(peers, "fwd", w, {}, alloc, ours_y),
        )
    return calls


def _add_native(calls: dict, ort, onednn) -> None:
    """ONNX Runtime's and oneDNN's calls, where they have one."""
    for name, call in (("ort", ort), ("onednn", onednn)):
        if call is not None:
            calls[name] = call


def _bwd(w: Workload, peers: Peers, alloc: bool) -> dict:
    x, g, dy = w.x, w.gamma, w.random()
    rstd = rmsnorm.rms_norm(x, g, EPS)[1]
    dx = None if alloc else aligned_empty_like(x)
    calls = {
        "ours": lambda: rmsnorm.rms_norm_backward(dy, x, g, rstd, out=dx),
        "numpy": lambda: numpy_bwd(dy, x, g, rstd),
    }
    if peers.torch is not None:
        torch = peers.torch
        xg = torch_view(torch, x).detach().requires_grad_()
        gg = torch_view(torch, g).detach().requires_grad_()
        dyt = torch_view(torch, dy)
        yt = torch.nn.functional.rms_norm(xg, (w.k,), gg, EPS)  # graph built once, reused
        calls["torch"] = lambda: torch.autograd.grad(yt, (xg, gg), dyt, retain_graph=True)
    if peers.jax is not None:
        jax = peers.jax
        fwd = jax_formula(jax)
        f = jax.jit(lambda dy, x, g: jax.vjp(fwd, x, g)[1](dy))
        dyj, xj, gj = (jax.numpy.asarray(a) for a in (dy, x, g))
        calls["jax"] = lambda: jax.block_until_ready(f(dyj, xj, gj))
    if peers.onednn is not None:
        ours_dx = rmsnorm.rms_norm_backward(dy, x, g, rstd)[0]
        _add_native(calls, None, onednn_call(peers, "bwd", w, {"dy": dy}, alloc, ours_dx))
    return calls


def _add(w: Workload, peers: Peers, alloc: bool) -> dict:
    x, g, r = w.x, w.gamma, w.random()
    y, h = (None, None) if alloc else (aligned_empty_like(x), aligned_empty_like(x))

    def unfused():  # writes the same out buffers as ours: both overwrite them every call
        total = np.add(x, r) if alloc else np.add(x, r, out=h)
        return rmsnorm.rms_norm(total, g, EPS, out=y)

    calls = {
        "ours": lambda: rmsnorm.add_rms_norm(x, r, g, EPS, out=y, residual_out=h),
        "numpy": lambda: numpy_add(x, r, g),
        "unfused": unfused,
    }
    if peers.torch is not None:
        torch = peers.torch
        xt, rt, gt = (torch_view(torch, a) for a in (x, r, g))

        def torch_add():
            ht = xt + rt
            return torch.nn.functional.rms_norm(ht, (w.k,), gt, EPS), ht

        calls["torch"] = torch_add
    if peers.jax is not None:
        jax = peers.jax
        fwd = jax_formula(jax)

        def add_then_norm(x, r, g):
            h = (x.astype(jax.numpy.float32) + r.astype(jax.numpy.float32)).astype(x.dtype)
            return fwd(h, g), h

        f = jax.jit(add_then_norm)
        xj, rj, gj = (jax.numpy.asarray(a) for a in (x, r, g))
        calls["jax"] = lambda: jax.block_until_ready(f(xj, rj, gj))
    if peers.ort is not None:
        ours_y = rmsnorm.add_rms_norm(x, r, g, EPS)[0]
        inputs = {"x": x, "r": r, "g": g}
        _add_native(calls, ort_call(peers, "add", w, inputs, alloc, ours_y), None)
    return calls


def torch_adapter(peers: Peers, w: Workload):
    """Our torch adapter as (forward(x) -> y, weight tensors), probing its likely entry points.

    Preferred: ``rmsnorm.torch.rms_norm`` (mirrors torch's functional), then
    ``RMSNormFunction.apply(x, weight, eps, offset)``, then the ``RMSNorm`` module.
    """
    torch, module = peers.torch, peers.torch_adapter
    gt = torch_view(torch, w.gamma).detach().clone().requires_grad_()
    candidates = []
    functional = getattr(module, "rms_norm", None)
    if functional is not None:
        candidates.append((lambda x: _first(functional(x, (w.k,), gt, EPS)), [gt]))
    function = getattr(module, "RMSNormFunction", None)
    if function is not None:
        candidates.append((lambda x: _first(function.apply(x, gt, EPS, 0.0)), [gt]))
    layer_class = getattr(module, "RMSNorm", None)
    if layer_class is not None:
        candidates.append(_torch_layer(torch, layer_class, w.k, gt))
    probe, why = torch_view(torch, w.x[:1].copy()), "nothing to call"
    for forward, params in candidates:
        try:
            forward(probe)
            return forward, params
        except Exception as exc:  # noqa: BLE001 - signature mismatch: try the next candidate
            why = f"{type(exc).__name__}: {exc}"
    raise RuntimeError(f"rmsnorm.torch has no usable rms_norm/RMSNormFunction/RMSNorm ({why})")


def _torch_layer(torch, layer_class, k: int, gt):
    """(forward, params) of the adapter's RMSNorm module with gamma's values and dtype."""
    layer = layer_class(k, eps=EPS).to(gt.dtype)
    with torch.no_grad():
        layer.weight.copy_(gt)
    return (lambda x: _first(layer(x))), list(layer.parameters())


def _torch_adapter_fwd(w: Workload, peers: Peers, alloc: bool) -> dict:
    torch = peers.torch
    forward, _ = torch_adapter(peers, w)
    xt, gt = torch_view(torch, w.x), torch_view(torch, w.gamma)

    def ours():
        with torch.no_grad():
            return forward(xt)

    def peer():
        with torch.no_grad():
            return torch.nn.functional.rms_norm(xt, (w.k,), gt, EPS)

    return {"ours": ours, "torch": peer}


def _torch_adapter_fwd_bwd(w: Workload, peers: Peers, alloc: bool) -> dict:
    torch = peers.torch
    forward, params = torch_adapter(peers, w)
    xg = torch_view(torch, w.x).detach().requires_grad_()
    gg = torch_view(torch, w.gamma).detach().requires_grad_()
    dyt = torch_view(torch, w.random())

    def ours():
        return torch.autograd.grad(forward(xg), [xg, *params], dyt)

    def peer():
        return torch.autograd.grad(torch.nn.functional.rms_norm(xg, (w.k,), gg, EPS), (xg, gg), dyt)

    return {"ours": ours, "torch": peer}


def _jit_or_plain(jax, f, *probe):
    """jax.jit(f) when our adapter traces under jit, else f itself."""
    try:
        jitted = jax.jit(f)
        jax.block_until_ready(jitted(*probe))
        return jitted
    except Exception:  # noqa: BLE001 - untraceable: time it eagerly
        return f


def _jax_adapter_fwd(w: Workload, peers: Peers, alloc: bool) -> dict:
    jax = peers.jax
    adapter = peers.jax_adapter.rms_norm
    xj, gj = jax.numpy.asarray(w.x), jax.numpy.asarray(w.gamma)
    ours = _jit_or_plain(jax, lambda x, g: _first(adapter(x, g)), xj[:1], gj)
    peer = jax.jit(jax_formula(jax))
    return {
        "ours": lambda: jax.block_until_ready(ours(xj, gj)),
        "jax": lambda: peer(xj, gj).block_until_ready(),
    }


def _jax_vjp(jax, forward):
    """(x, gamma, dy) -> (y, (dx, dgamma)): the forward and the backward with upstream dy, as
    torch.autograd.grad does it (no loss reduction)."""

    def fwd_bwd(x, gamma, dy):
        y, backward = jax.vjp(forward, x, gamma)
        return y, backward(dy)

    return fwd_bwd


def _jax_adapter_with_dy(w: Workload, peers: Peers, transform) -> dict:
    """Ours and jax.jit's for transform(forward) -> fn(x, gamma, dy), an upstream dy given."""
    jax = peers.jax
    adapter = peers.jax_adapter.rms_norm
    xj, gj, dyj = (jax.numpy.asarray(a) for a in (w.x, w.gamma, w.random()))
    ours = _jit_or_plain(jax, transform(lambda x, g: _first(adapter(x, g))), xj[:1], gj, dyj[:1])
    peer = jax.jit(transform(jax_formula(jax)))
    return {
        "ours": lambda: jax.block_until_ready(ours(xj, gj, dyj)),
        "jax": lambda: jax.block_until_ready(peer(xj, gj, dyj)),
    }


def _jax_adapter_fwd_bwd(w: Workload, peers: Peers, alloc: bool) -> dict:
    return _jax_adapter_with_dy(w, peers, lambda forward: _jax_vjp(peers.jax, forward))


def _jax_adapter_vg(w: Workload, peers: Peers, alloc: bool) -> dict:
    jax = peers.jax
    return _jax_adapter_with_dy(
        w, peers, lambda forward: jax.value_and_grad(jax_loss(jax, forward), (0, 1))
    )


# --------------------------------------------------------------------------- timing


@dataclass
class Row:
    """One measured (or skipped) configuration and its median seconds per contender."""

    op: str
    shape: tuple
    dtype: str
    isa: str
    threads: int
    seconds: dict = field(default_factory=dict)
    skipped: set = field(default_factory=set)
    us_per_call: float | None = None
    reps: int = 0
    note: str = ""

    @property
    def bytes_moved(self) -> int:
        """Bytes an ideal kernel reads and writes for this row (see ARRAYS_MOVED)."""
        return ARRAYS_MOVED[self.op] * math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def ratio(self, name: str):
        """Peer time / our time (a speed-up), "skip", or None when not measured."""
        if name in self.skipped:
            return "skip"
        if name in self.seconds and "ours" in self.seconds:
            return self.seconds[name] / self.seconds["ours"]
        return None

    @property
    def over_copy(self):
        """Our time / roofline time: 1.0 means as fast as copying the same bytes."""
        if "copy" in self.seconds and "ours" in self.seconds:
            return self.seconds["ours"] / self.seconds["copy"]
        return None

    @property
    def gbps(self):
        """Our bandwidth in GB/s (bytes_moved / our median time)."""
        return self.bytes_moved / self.seconds["ours"] / 1e9 if "ours" in self.seconds else None


def _call_seconds(fn: Callable) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def warm_up(calls: dict, known_slow: set) -> tuple[dict, set]:
    """Call each contender once or twice; returns per-call estimates and the skipped peers."""
    estimates, skipped = {}, set()
    for name, fn in calls.items():
        if name in known_slow:
            skipped.add(name)
            continue
        first = _call_seconds(fn)  # includes JIT compilation and first-touch page faults
        if name in PEERS and name != "jax" and first > SLOW_PEER_S:  # jax: compile time
            skipped.add(name)
            continue
        if first < WARM_AGAIN_S:  # cheap: a second call for an estimate free of first touches
            first = min(first, _call_seconds(fn))
        if name in PEERS and first > SLOW_PEER_S:
            skipped.add(name)
            continue
        estimates[name] = first
    return estimates, skipped


def measure(calls: dict, estimates: dict, reps: int, settle_after=frozenset()) -> dict:
    """Median seconds per call; contenders interleaved within each repetition. Each contender
    named in settle_after (those that run XLA) is followed by a pause of XLA_SETTLE_S."""
    loops = {name: max(1, int(SAMPLE_S / max(t, 1e-9))) for name, t in estimates.items()}
    samples = {name: [] for name in estimates}
    gc.disable()
    try:
        for _ in range(reps):
            for name in estimates:
                fn, n = calls[name], loops[name]
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                samples[name].append((time.perf_counter() - start) / n)
                if name in settle_after:
                    time.sleep(XLA_SETTLE_S)
    finally:
        gc.enable()
    return {name: statistics.median(values) for name, values in samples.items()}


def micros_per_call(fn: Callable, estimate: float, repeat: int = 5) -> float:
    """timeit-style best of `repeat` runs of many calls, in microseconds per call."""
    number = max(10, int(0.02 / max(estimate, 1e-9)))
    return min(timeit.Timer(fn).repeat(repeat, number)) / number * 1e6


def time_row(row: Row, calls: dict, reps: int, known_slow: set) -> Row:
    """Fill row.seconds (and us_per_call for small calls) at the row's ISA and threads."""
    rmsnorm.set_isa(row.isa)
    rmsnorm.set_num_threads(row.threads)
    estimates, row.skipped = warm_up(calls, known_slow)
    known_slow |= row.skipped
    round_seconds = sum(estimates.values())
    row.reps = max(MIN_REPS, min(reps, int(REP_BUDGET_S / max(round_seconds, 1e-9))))
    xla = {"jax", "ours"} if row.op.startswith("jax.") else {"jax"}
    row.seconds = measure(calls, estimates, row.reps, xla)
    if "copy_pf" in row.seconds:  # the roofline: the faster copy on this CPU
        row.seconds["copy"] = min(row.seconds["copy"], row.seconds["copy_pf"])
    if row.bytes_moved < SMALL_BYTES:
        row.us_per_call = micros_per_call(calls["ours"], estimates["ours"])
    return row


# --------------------------------------------------------------------------- plan and run


@dataclass
class Group:
    """All rows of one (shape, dtype, op): built once, timed at each (threads, isa)."""

    shape: tuple
    dtype: str
    op: str
    variants: list


def isas_for(policy: str, shape: tuple, threads: int, thread_counts: list) -> list:
    """ISAs to time for a core-op row under --isa (see --help)."""
    available = rmsnorm.available_isas()
    if policy == "best":
        return available[:1]
    if policy == "all":
        return available
    if policy == "auto":
        subset = shape in ISA_SUBSET_SHAPES and threads in (1, max(thread_counts))
        return available if subset else available[:1]
    return [name for name in policy.split(",") if name]


def make_plan(args, peers: Peers) -> list:
    """Groups in run order: shape, dtype, op (core ops, then adapters), threads, ISA."""
    plan = []
    for shape in args.shapes:
        for dtype in args.dtypes:
            for op in args.ops:
                variants = _variants(op, shape, args, peers)
                if variants:
                    plan.append(Group(shape, dtype, op, variants))
    return plan


def _variants(op: str, shape: tuple, args, peers: Peers) -> list:
    """(threads, isa) pairs for one op: adapters at the best ISA, JAX at all cores only."""
    all_cores = usable_cpus()
    if op.startswith("jax."):
        threads = [all_cores] if peers.jax_adapter is not None else []
    elif op.startswith("torch."):
        threads = [] if peers.torch_adapter is None else args.adapter_threads
    else:
        return [
            (t, isa) for t in args.threads for isa in isas_for(args.isa, shape, t, args.threads)
        ]
    return [(t, isas_for(args.isa, shape, t, args.threads)[0]) for t in threads]


def run_group(group: Group, workload: Workload, peers: Peers, args, known_slow: dict):
    """Yield one Row per (threads, isa) of the group; errors become rows with a note."""
    try:
        calls = build_contenders(group.op, workload, peers, args)
    except Exception as exc:  # noqa: BLE001 - one broken path must not end the sweep
        for threads, isa in group.variants:
            yield Row(
                group.op,
                group.shape,
                group.dtype,
                isa,
                threads,
                note=f"error: {type(exc).__name__}: {exc}",
            )
        return
    all_cores = usable_cpus()
    slow = known_slow.setdefault((group.op, group.shape, group.dtype), set())
    for threads, isa in group.variants:
        if peers.torch is not None:
            peers.torch.set_num_threads(threads)
        active = {  # the pools of XLA and oneDNN's runtime take every core
            name: fn
            for name, fn in calls.items()
            if not (name in ("jax", "onednn") and threads != all_cores)
        }
        row = Row(group.op, group.shape, group.dtype, isa, threads)
        try:
            yield time_row(row, active, args.reps, slow)
        except Exception as exc:  # noqa: BLE001 - as above
            row.seconds, row.note = {}, f"error: {type(exc).__name__}: {exc}"
            yield row


def run_plan(plan: list, peers: Peers, args, emit: Callable, progress) -> list:
    """Time every group, reusing one Workload per (shape, dtype); returns all rows."""
    rows, workload, known_slow = [], None, {}
    for group in plan:
        dtype = DTYPES[group.dtype]
        progress.describe(f"{group.op} {shape_text(group.shape)} {group.dtype}")
        need_mb = working_set_mb(group.op, group.shape, dtype, not args.no_peers)
        if need_mb > args.max_mb:
            row = Row(
                group.op,
                group.shape,
                group.dtype,
                "-",
                0,
                note=f"skipped: working set ~{need_mb:.0f} MB > --max-mb {args.max_mb}",
            )
            rows.append(row)
            emit(row)
            progress.advance(len(group.variants))
            continue
        if workload is None or (workload.shape, workload.dtype) != (group.shape, dtype):
            workload = None  # free the previous inputs before making the next ones
            workload = Workload(group.shape, dtype, args.seed)
        for row in run_group(group, workload, peers, args, known_slow):
            rows.append(row)
            emit(row)
            progress.advance(1)
    rmsnorm.set_isa(rmsnorm.available_isas()[0])
    return rows


# --------------------------------------------------------------------------- output


COLUMNS = [
    ("op", 13),
    ("shape", 14),
    ("dtype", 5),
    ("isa", 6),
    ("thr", 3),
    ("ms", 9),
    ("us/call", 7),
    ("GB/s", 6),
    ("t/copy", 6),
    *((f"{peer}_x", max(len(peer) + 2, 6)) for peer in PEERS),  # speed-ups, PEERS order
    ("note", 0),
]


def shape_text(shape: tuple) -> str:
    """(8192, 4096) -> "8192x4096"."""
    return "x".join(str(n) for n in shape)


def _number(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:.{digits}f}"


def row_cells(row: Row) -> list:
    """The table cells of a row, in COLUMNS order."""
    ms = row.seconds.get("ours")
    return [
        row.op,
        shape_text(row.shape),
        row.dtype,
        row.isa,
        str(row.threads or "-"),
        "-" if ms is None else f"{ms * 1e3:.4g}",
        _number(row.us_per_call),
        _number(row.gbps, 1),
        _number(row.over_copy),
        *(_number(row.ratio(peer)) for peer in PEERS),
        row.note,
    ]


def _numeric(column: int) -> bool:
    """Columns ms .. unfused_x hold numbers (right-aligned); the rest are labels."""
    return 4 < column < len(COLUMNS) - 1


def text_line(cells: list) -> str:
    """One fixed-width table line: labels left-aligned, numbers right-aligned."""
    parts = [
        cell.rjust(width) if _numeric(i) else cell.ljust(width)
        for i, ((_, width), cell) in enumerate(zip(COLUMNS, cells))
    ]
    return " ".join(parts).rstrip()


def markdown_table(rows: list) -> str:
    """All rows as a GitHub Markdown table (for the README)."""
    lines = [
        "| " + " | ".join(name for name, _ in COLUMNS) + " |",
        "|" + "|".join("---:" if _numeric(i) else "---" for i in range(len(COLUMNS))) + "|",
    ]
    lines += ["| " + " | ".join(row_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


CSV_FIELDS = [
    "op",
    "shape",
    "dtype",
    "isa",
    "threads",
    "ms",
    "us_per_call",
    "gbps",
    "t_over_copy",
    *(f"speedup_{peer}" for peer in PEERS),
    *(f"ms_{name}" for name in CONTENDERS[1:]),
    "bytes_moved",
    "reps",
    "note",
]


def _csv_value(value):
    return "" if value is None else (f"{value:.6g}" if isinstance(value, float) else value)


def write_csv(rows: list, path: str) -> None:
    """Every row with raw median times (ms) of each contender, not just the ratios."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_FIELDS)
        for row in rows:
            ms = {
                name: row.seconds[name] * 1e3 if name in row.seconds else None
                for name in CONTENDERS
            }
            values = [
                row.op,
                shape_text(row.shape),
                row.dtype,
                row.isa,
                row.threads,
                ms["ours"],
                row.us_per_call,
                row.gbps,
                row.over_copy,
                *(row.ratio(peer) for peer in PEERS),
                *(ms[name] for name in CONTENDERS[1:]),
                row.bytes_moved,
                row.reps,
                row.note,
            ]
            writer.writerow([_csv_value(v) for v in values])


# What each row of panels in the PNG shows: the ratio to the roofline, then each peer's speed-up.
PLOT_METRICS = {
    "roofline": "our time / roofline (below 1: faster than a copy)",
    "numpy": "speed-up over NumPy",
    "torch": "speed-up over torch",
    "jax": "speed-up over JAX (jit)",
    "ort": "speed-up over ONNX Runtime",
    "onednn": "speed-up over oneDNN",
    "unfused": "speed-up over np.add + rms_norm",
}
PLOT_GAP = 1.5  # bar widths between two thread counts' groups of bars


def plot_value(row: Row, metric: str):
    """A panel's bar for a row: a float, "skip" (a peer too slow to time) or None."""
    return row.over_copy if metric == "roofline" else row.ratio(metric)


def write_png(rows: list, path: str) -> bool:
    """Bar charts of the best ISA's core-op rows: a row of panels per (op, metric) that has
    values, a column per dtype; in each panel one bar per shape, grouped by thread count, drawn
    from 1 (the roofline, or a peer's speed) on a log scale."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return False
    best = rmsnorm.available_isas()[0]
    rows = [r for r in rows if r.op in CORE_OPS and r.isa == best and "ours" in r.seconds]
    panels = [
        (op, metric)
        for op in CORE_OPS
        for metric in PLOT_METRICS
        if any(r.op == op and plot_value(r, metric) is not None for r in rows)
    ]
    if not panels:
        return False
    dtypes = [d for d in DTYPES if any(r.dtype == d for r in rows)]
    shapes = list(dict.fromkeys(r.shape for r in rows))  # the same bars in every panel
    threads = sorted({r.threads for r in rows})
    colors = _shape_colors(plt, shapes)
    group_width = len(shapes) + PLOT_GAP
    fig, axes = plt.subplots(
        len(panels),
        len(dtypes),
        squeeze=False,
        figsize=(len(dtypes) * max(3.5, 1.2 + 0.1 * group_width * len(threads)), 2.6 * len(panels)),
    )
    for (op, metric), axes_row in zip(panels, axes):
        for dtype, ax in zip(dtypes, axes_row):
            panel = [r for r in rows if r.op == op and r.dtype == dtype]
            _bar_panel(ax, panel, metric, shapes, threads, colors)
            ax.set_title(f"{op} {dtype}: {PLOT_METRICS[metric]}", fontsize=8)
    inch = 1 / fig.get_figheight()  # figure coordinates of one inch of height
    fig.suptitle(
        f"rmsnorm ({best}): bars from 1, log scale; x = peer skipped (slower than "
        f"{SLOW_PEER_S:g} s a call)",
        fontsize=10,
        y=1 - 0.1 * inch,
        va="top",
    )
    fig.legend(
        handles=[Patch(color=colors[s], label=shape_text(s)) for s in shapes],
        loc="upper center",
        bbox_to_anchor=(0.5, 1 - 0.35 * inch),
        ncol=min(len(shapes), 10),
        fontsize=7,
        frameon=False,
    )
    top = 1 - (0.45 + 0.2 * -(-len(shapes) // 10)) * inch
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _shape_colors(plt, shapes: list) -> dict:
    """A colour per shape; with more than ten, tab20's dark shades first, then its light ones,
    so that neighbouring shapes do not get two shades of one hue."""
    if len(shapes) <= 10:
        cmap = plt.get_cmap("tab10")
        return {shape: cmap(i) for i, shape in enumerate(shapes)}
    cmap = plt.get_cmap("tab20")
    order = [*range(0, 20, 2), *range(1, 20, 2)]
    return {shape: cmap(order[i % 20]) for i, shape in enumerate(shapes)}


def _bar_panel(ax, rows: list, metric: str, shapes: list, threads: list, colors: dict) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    group_width = len(shapes) + PLOT_GAP
    values = []
    for g, count in enumerate(threads):
        by_shape = {r.shape: plot_value(r, metric) for r in rows if r.threads == count}
        for i, shape in enumerate(shapes):
            x, value = g * group_width + i, by_shape.get(shape)
            if value == "skip":
                ax.plot(x, 1.0, marker="x", color=colors[shape], markersize=4)
            elif value is not None and value > 0:
                ax.bar(x, value - 1.0, bottom=1.0, width=0.85, color=colors[shape])
                values.append(value)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    low, high = min(values + [1.0]) / 1.15, max(values + [1.0]) * 1.15
    ax.set_ylim(low, high)
    # Ticks at 1, 2, 5 times powers of ten, or finer steps where the range is narrow.
    for steps in ((1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.1, 1.2, 1.5, 2, 3, 5, 7, 8)):
        ticks = [
            m * 10.0**e
            for e in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
            for m in steps
            if low <= m * 10.0**e <= high
        ]
        if len(ticks) >= 3:
            break
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    centers = [g * group_width + (len(shapes) - 1) / 2 for g in range(len(threads))]
    ax.set_xticks(centers, [f"{count} thr" for count in threads], fontsize=8)
    ax.set_xlim(-1, len(threads) * group_width - PLOT_GAP)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="y", which="major", linewidth=0.3, alpha=0.5)


# --------------------------------------------------------------------------- progress


class Progress:
    """tqdm on stderr when installed, else a one-line stderr bar; rows print above it."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.text = total, 0, ""
        self.enabled, self.bar = enabled, None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, unit="row", leave=False)
            except ImportError:
                pass

    def describe(self, text: str) -> None:
        self.text = text
        if self.bar is not None:
            self.bar.set_description(text)
        else:
            self._draw()

    def advance(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        else:
            self._draw()

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
            return
        self._clear()
        print(line, flush=True)
        self._draw()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            self._clear()

    def _draw(self) -> None:
        if self.enabled:
            filled = 30 * self.done // max(self.total, 1)
            sys.stderr.write(
                f"\r[{'#' * filled}{'.' * (30 - filled)}] "
                f"{self.done}/{self.total} {self.text[:40]:40}"
            )
            sys.stderr.flush()

    def _clear(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 80 + "\r")


# --------------------------------------------------------------------------- header, CLI


def cpu_model() -> str:
    """The CPU's marketing name (Linux /proc/cpuinfo, else platform)."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def header_lines(args, peers: Peers) -> list:
    """CPU, versions, ISAs, thread counts and how to read the columns."""

    def version(name):
        module = sys.modules.get(name)
        return getattr(module, "__version__", "?") if module is not None else "not loaded"

    all_cores = usable_cpus()
    freed = "kept (--reuse-buffers)" if args.reuse_buffers else "unmapped (glibc default)"
    omp_env = " ".join(f"{k}={os.environ[k]}" for k in OMP_ENV if k in os.environ) or "unset"
    lines = [
        (
            f"rmsnorm benchmark  CPU: {cpu_model()} ({all_cores} logical cores), "
            f"{platform.system()} {platform.machine()}; OpenMP env: {omp_env}"
        ),
        (
            f"versions: python {platform.python_version()}, rmsnorm {version('rmsnorm')}, "
            f"numpy {np.__version__}, ml_dtypes {version('ml_dtypes')}, "
            f"torch {version('torch')}, jax {version('jax')}, "
            f"onnxruntime {version('onnxruntime')}, oneDNN {_onednn_version(peers)}"
        ),
        (
            f"ISAs available: {', '.join(rmsnorm.available_isas())} (policy --isa {args.isa}); "
            f"threads: {', '.join(map(str, args.threads))}"
        ),
        (
            f"ours: {'allocating outputs' if args.alloc else 'out= preallocated'}; eps={EPS}; "
            f"median of up to {args.reps} interleaved repetitions after warm-up "
            f"({XLA_SETTLE_S:g} s pause after each call that ran XLA); "
            f"large freed blocks {freed}"
        ),
        (
            "t/copy = our time / rmsnorm._core copy (fwd), triad (bwd), two copies (add) of the "
            "same bytes, each copy the faster of a plain and a prefetching one: 1.0 = memory "
            "roofline"
        ),
        (
            "numpy_x, torch_x, jax_x, ort_x (ONNX Runtime), onednn_x = peer time / our time "
            "(speed-up; bwd = backward only); unfused_x = (np.add + rms_norm) / add_rms_norm"
        ),
        (
            f"JAX and oneDNN: timed only at all cores ({all_cores} threads: XLA's CPU pool and "
            "oneDNN's runtime can't be resized in-process); ONNX Runtime: a session per thread "
            f"count, not spinning; peers slower than {SLOW_PEER_S:g} s/call are 'skip'; "
            "us/call = timeit best for small calls"
        ),
    ]
    return lines + [f"note: {note}" for note in peers.notes]


def _onednn_version(peers: Peers) -> str:
    if peers.onednn is None:
        return "not loaded"
    try:
        return peers.onednn.version()
    except Exception:  # noqa: BLE001 - the version is only shown
        return "?"


def _shape_arg(text: str) -> tuple:
    return tuple(int(n) for n in text.lower().split("x"))


def default_threads() -> list:
    """1, 2, 4, ... below the core count, then the core count."""
    cores, counts, n = usable_cpus(), [], 1
    while n < cores:
        counts.append(n)
        n *= 2
    return [*counts, cores]


def parse_args(argv=None):
    """Command-line options, with the --quick defaults filled in."""
    parser = argparse.ArgumentParser(
        prog="python -m rmsnorm.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="under a minute: 2048x4096 and 1x4096, fp32/bf16, threads 1 and "
        "all cores, best ISA, 3 repetitions, peers included, adapters at all cores only",
    )
    parser.add_argument(
        "--isa",
        default=None,
        help="auto (default for the full sweep): best ISA everywhere plus every "
        "ISA on 1x4096, 64x4096, 8192x4096 at 1 thread and all cores; best "
        "(default with --quick); all; or a comma list, e.g. avx2,scalar",
    )
    parser.add_argument("--threads", help="comma list (default 1,2,4,... and all cores)")
    parser.add_argument(
        "--shapes",
        help="comma list like 8192x4096,1024x1x12288 "
        "(default: the TE sweep, torch_npu, decode and odd shapes)",
    )
    parser.add_argument("--dtypes", default="fp32,bf16,fp16", help="comma list of fp32,bf16,fp16")
    parser.add_argument(
        "--ops",
        default=",".join(CORE_OPS + ADAPTER_OPS),
        help="comma list of fwd,bwd,add and the adapter rows torch.fwd,"
        "torch.fwd+bwd,jax.fwd,jax.fwd+bwd,jax.vg (adapters run when importable)",
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help="repetitions per row (default 7, 3 with --quick; fewer when slow)",
    )
    parser.add_argument(
        "--max-mb",
        type=float,
        default=2048,
        help="skip rows whose estimated working set exceeds this (default 2048)",
    )
    parser.add_argument(
        "--no-peers",
        action="store_true",
        help="time only ours and the roofline (no numpy/torch/jax/ONNX Runtime/oneDNN)",
    )
    parser.add_argument(
        "--alloc",
        action="store_true",
        help="let our calls allocate outputs instead of out= buffers",
    )
    parser.add_argument(
        "--reuse-buffers",
        action="store_true",
        help="call rmsnorm.jax.reuse_large_buffers() first: glibc then keeps freed large blocks, "
        "so fresh XLA (and NumPy) outputs reuse faulted-in pages; process-wide, both sides",
    )
    parser.add_argument("--csv", default="bench.csv", help="CSV path ('' to skip)")
    parser.add_argument(
        "--png",
        default="bench.png",
        help="PNG path ('' to skip): a bar per shape, grouped by thread count, of the ratio to "
        "the roofline and of the speed-up over each peer (needs matplotlib)",
    )
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the table as Markdown (for the README) when done",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    return _resolve(parser, parser.parse_args(argv))


def _resolve(parser, args):
    """Fill the defaults that depend on --quick and validate the lists."""
    cores = usable_cpus()
    if args.quick:
        args.shapes = args.shapes or ",".join(map(shape_text, QUICK_SHAPES))
        args.dtypes = "fp32,bf16" if args.dtypes == "fp32,bf16,fp16" else args.dtypes
        args.threads = args.threads or ",".join(map(str, sorted({1, cores})))
    args.isa = args.isa or ("best" if args.quick else "auto")
    args.reps = args.reps or (3 if args.quick else 7)
    args.shapes = [_shape_arg(s) for s in args.shapes.split(",")] if args.shapes else ALL_SHAPES
    args.dtypes = args.dtypes.split(",")
    args.threads = [int(t) for t in args.threads.split(",")] if args.threads else default_threads()
    args.ops = args.ops.split(",")
    args.adapter_threads = [max(args.threads)] if args.quick else args.threads
    for name, given, allowed in (
        ("dtype", args.dtypes, DTYPES),
        ("op", args.ops, CORE_OPS + ADAPTER_OPS),
    ):
        unknown = [g for g in given if g not in allowed]
        if unknown:
            parser.error(f"unknown {name} {unknown}; choose from {list(allowed)}")
    if args.isa not in ("auto", "best", "all"):
        missing = [i for i in args.isa.split(",") if i not in rmsnorm.available_isas()]
        if missing:
            parser.error(f"ISA {missing} not available; have {rmsnorm.available_isas()}")
    return args


def main(argv=None) -> int:
    """Run the benchmark; returns the process exit code."""
    args = parse_args(argv)
    wants = {op.split(".")[0] for op in args.ops}
    peers = load_peers(
        not args.no_peers or "torch" in wants,
        not args.no_peers or "jax" in wants,
        want_adapters=bool(wants & {"torch", "jax"}),
        want_native=not args.no_peers,
    )
    if args.reuse_buffers:
        adapter, why = _optional("rmsnorm.jax")
        if adapter is None:
            print(f"error: --reuse-buffers needs rmsnorm.jax ({why})")
            return 2
        args.reuse_buffers = adapter.reuse_large_buffers()
    plan = make_plan(args, peers)
    for line in header_lines(args, peers):
        print(("- " if args.markdown else "# ") + line)
    noted = len(peers.notes)
    progress = Progress(sum(len(g.variants) for g in plan), enabled=not args.no_progress)
    if not args.markdown:
        progress.write(text_line([name for name, _ in COLUMNS]))

    def emit(row: Row) -> None:
        if not args.markdown:
            progress.write(text_line(row_cells(row)))

    try:
        rows = run_plan(plan, peers, args, emit, progress)
    finally:
        progress.close()
    for note in dict.fromkeys(peers.notes[noted:]):  # what the peers could not do, once each
        print(("- " if args.markdown else "# ") + f"note: {note}")
    if args.markdown:
        print()
        print(markdown_table(rows))
    if args.csv:
        write_csv(rows, args.csv)
        print(f"# wrote {args.csv}", file=sys.stderr)
    if args.png and write_png(rows, args.png):
        print(f"# wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
