# Side-by-side A/B of two builds of rmsnorm's extension: `python benchmarks/ab.py --help`.
"""Time two builds of ``rmsnorm._core`` against each other in one process.

"old" is a ``_core*.so`` file (``--old``), "new" is the ``rmsnorm._core`` of the checkout this
script lives in (or ``--new FILE``). Both are loaded side by side, each under its own module
name, and every cell of ``python -m rmsnorm.bench``'s shapes x dtypes x ops (fwd, bwd, add) x
thread counts is timed with the two builds' calls alternating in interleaved rounds (old-new,
new-old, ...) on the same inputs, each writing its own preallocated outputs. The result is the
median time of each build and new/old per cell, the geometric mean of new/old per thread count
and overall, the worst cell and the cells above the --limit. A cell above the limit is timed
again with three times the rounds (--recheck), as a burst of other load on the machine can push
a cell over where a real slowdown stays.

Once per cell the two builds' outputs are compared: y, dx and the residual stream to one unit in
the last place of the dtype (y and dx also within float32 arithmetic noise of the row's scale;
the residual stream exactly), rstd to a few float32 ulps and dgamma to float32 summation error.
A cell that differs is flagged in the "check" column and counted in the summary.

The old build of a commit, e.g.::

    git worktree add /tmp/old 844ab66 && (cd /tmp/old && python setup.py build_ext --inplace)
    python benchmarks/ab.py --old /tmp/old/rmsnorm/_core.cpython-311-x86_64-linux-gnu.so
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import importlib.machinery
import importlib.util
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the old build is looked for when --old is not given.
DEFAULT_OLD = "/work/old-core/_core.cpython-311-x86_64-linux-gnu.so"
EPS = 1e-6
OPS = ("fwd", "bwd", "add")
QUICK_SHAPES = [(2048, 4096), (64, 4096), (1, 4096), (29, 17389)]
SAMPLE_S = 0.01  # one timing sample loops a call until about this long (small shapes)
LIMIT = 1.15  # cells whose new/old is above this are listed
# Float32 ulps that rstd may differ by: a sum of squares in another order, then 1/sqrt.
RSTD_ULPS = 8
# Multiples of float32's epsilon times a row's largest |output| that y and dx may differ by, on
# top of one ulp of the dtype: both are a product (and dx a difference) of float32 quantities
# whose reductions may run in another order, so small elements of a row can differ by more
# ulps of their own than large ones.
ROW_NOISE = 16
CHUNK = 1 << 22  # elements compared at a time, so that a check needs little memory


def _use_checkout() -> None:
    """Import rmsnorm from the checkout holding this script, before any installed copy."""
    if os.path.isfile(os.path.join(ROOT, "rmsnorm", "__init__.py")):
        sys.path.insert(0, ROOT)


_use_checkout()

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

try:
    from rmsnorm.bench import (
        ALL_SHAPES,
        DTYPES,
        OMP_ENV,
        _shape_arg,
        aligned_empty_like,
        cpu_model,
        shape_text,
    )
except ImportError as exc:  # pragma: no cover - reported to the user
    sys.exit(
        f"error: cannot import rmsnorm from {ROOT} ({exc}); build it there first with "
        "`python setup.py build_ext --inplace`"
    )


# --------------------------------------------------------------------------- the two builds


def load_core(path: str, package: str):
    """Load a built `_core` extension file as `<package>._core`: the module's init function is
    named after the last component, so any package name works and two builds can coexist."""
    name = f"{package}._core"
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module
    return module


def core_path(module) -> str:
    return os.path.realpath(module.__file__)


def load_builds(args, scratch: str):
    """(old, new, notes): the two modules, loaded from distinct files."""
    notes = []
    if args.new:
        new = load_core(args.new, "rms_ab_new")
    else:
        from rmsnorm import _core as new
    old_path = args.old
    if os.path.realpath(old_path) == core_path(new):
        # One file loaded twice would be one code image with one set of globals: a copy gives
        # the old side its own, as two different builds have.
        copy = os.path.join(scratch, os.path.basename(old_path))
        shutil.copy2(old_path, copy)
        notes.append(f"old is a copy of {old_path} (a self-A/B: the noise floor)")
        old_path = copy
    return load_core(old_path, "rms_ab_old"), new, notes


def describe_build(path: str) -> str:
    """The file, its size and date, and the commit of the checkout it sits in (if any)."""
    stat = os.stat(path)
    when = datetime.datetime.fromtimestamp(stat.st_mtime).strftime("%Y-%m-%d %H:%M")
    text = f"`{path}` ({stat.st_size / 2**20:.1f} MiB, built {when}"
    try:
        commit = subprocess.run(
            ["git", "-C", os.path.dirname(path), "log", "-1", "--format=%h %s"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", os.path.dirname(path), "status", "--porcelain", "-uno"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if commit.returncode == 0 and commit.stdout.strip():
            subject = commit.stdout.strip()
            subject = subject if len(subject) <= 60 else subject[:57] + "..."
            changes = " + changes" if dirty.stdout.strip() else ""
            text += f", in a checkout now at {subject}{changes}"
    except (OSError, subprocess.SubprocessError):
        pass
    return text + ")"


# --------------------------------------------------------------------------- one cell


@dataclass
class Cell:
    shape: tuple
    dtype: str
    op: str
    threads: int
    old_s: float = math.nan
    new_s: float = math.nan
    reps: int = 0
    loops: int = 0
    check: str = ""
    flagged: bool = False

    @property
    def ratio(self) -> float:
        return self.new_s / self.old_s


@dataclass
class Inputs:
    """Random inputs of one (shape, dtype), shared by the ops, threads and both builds."""

    shape: tuple
    dtype: np.dtype
    rng: np.random.Generator = field(repr=False)
    x: np.ndarray = field(init=False, repr=False)
    gamma: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        self.x = self.random()
        self.gamma = self.rng.uniform(0.5, 1.5, self.shape[-1]).astype(self.dtype)

    def random(self) -> np.ndarray:
        return self.rng.standard_normal(self.shape, dtype=np.float32).astype(self.dtype)


def make_calls(op: str, inp: Inputs, old, new) -> tuple[dict, dict]:
    """({"old": fn, "new": fn}, outputs): each fn returns the build's outputs by name."""
    x, g = inp.x, inp.gamma
    calls, extra = {}, {}
    if op == "fwd":
        for side, core in (("old", old), ("new", new)):
            y = aligned_empty_like(x)
            calls[side] = _fwd_call(core, x, g, y)
    elif op == "add":
        r = extra["residual"] = inp.random()
        for side, core in (("old", old), ("new", new)):
            y, h = aligned_empty_like(x), aligned_empty_like(x)
            calls[side] = _add_call(core, x, r, g, y, h)
    else:
        dy = extra["dy"] = inp.random()
        rstd = extra["rstd"] = new.rms_norm(x, g, EPS)[1]
        for side, core in (("old", old), ("new", new)):
            dx = aligned_empty_like(x)
            calls[side] = _bwd_call(core, dy, x, g, rstd, dx)
    return calls, extra


def _fwd_call(core, x, g, y):
    def call():
        _, rstd = core.rms_norm(x, g, EPS, out=y)
        return {"y": y, "rstd": rstd}

    return call


def _add_call(core, x, r, g, y, h):
    def call():
        _, rstd, _ = core.add_rms_norm(x, r, g, EPS, out=y, residual_out=h)
        return {"y": y, "rstd": rstd, "h": h}

    return call


def _bwd_call(core, dy, x, g, rstd, dx):
    def call():
        _, dgamma = core.rms_norm_backward(dy, x, g, rstd, out=dx)
        return {"dx": dx, "dgamma": dgamma}

    return call


def _once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_pair(calls: dict, reps: int) -> tuple[float, float, int]:
    """Median seconds per call of old and new, alternating which goes first in each round, and
    the calls per sample (the same for both)."""
    for fn in calls.values():  # first touches of the outputs, lazy binding, OpenMP's pool
        fn()
    estimate = min(min(_once(fn), _once(fn)) for fn in calls.values())
    loops = max(1, int(SAMPLE_S / max(estimate, 1e-9)))
    samples = {"old": [], "new": []}
    gc.disable()
    try:
        for rep in range(reps):
            for side in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                fn = calls[side]
                start = time.perf_counter()
                for _ in range(loops):
                    fn()
                samples[side].append((time.perf_counter() - start) / loops)
    finally:
        gc.enable()
    return statistics.median(samples["old"]), statistics.median(samples["new"]), loops


# --------------------------------------------------------------------------- agreement


def _ordered(a: np.ndarray) -> np.ndarray:
    """Float bits as integers that count ulps: adjacent floats differ by 1, +0 == -0."""
    bits = a.view(f"i{a.dtype.itemsize}").astype(np.int64)
    magnitude = bits & ((1 << (8 * a.dtype.itemsize - 1)) - 1)
    return np.where(bits < 0, -magnitude, magnitude)


def max_ulps(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in ulps of a's dtype between a and b (NaN where only one is NaN)."""
    a, b = a.reshape(-1), b.reshape(-1)
    worst = 0
    for start in range(0, a.size, CHUNK):
        ca, cb = a[start : start + CHUNK], b[start : start + CHUNK]
        nan_a, nan_b = np.isnan(ca.astype(np.float32)), np.isnan(cb.astype(np.float32))
        if not np.array_equal(nan_a, nan_b):
            return -1
        distance = np.abs(_ordered(ca) - _ordered(cb))[~nan_a]
        worst = max(worst, int(distance.max(initial=0)))
    return worst


def _rows_of(a: np.ndarray, k: int):
    """Float32 copies of a's rows, CHUNK elements or so at a time, with their row offset."""
    a2 = a.reshape(-1, k)
    step = max(1, CHUNK // k)
    for start in range(0, a2.shape[0], step):
        yield start, a2[start : start + step].astype(np.float32)


def _excess(a: np.ndarray, b: np.ndarray, tolerance) -> float:
    """Largest |a - b| beyond one ulp of a's dtype, in units of tolerance(start, rows of a)."""
    k, worst = a.shape[-1], 0.0
    for (start, ca), (_, cb) in zip(_rows_of(a, k), _rows_of(b, k)):
        ulp = np.spacing(np.abs(ca).astype(a.dtype)).astype(np.float32)
        tol = np.maximum(tolerance(start, ca), np.finfo(np.float32).tiny)
        excess = (np.abs(ca - cb) - ulp) / tol
        if np.isnan(excess).any():
            return math.inf
        worst = max(worst, float(excess.max(initial=0.0)))
    return worst


def _y_excess(a, b, rstd_a, rstd_b) -> float:
    """y's difference beyond one ulp, in units of what the rows' rstd difference explains (y is
    proportional to rstd) plus the float32 roundings of the products: each build rounds x * rstd
    * w twice, in its own order, so two float32 results may differ by 4 * 2**-24 of y."""
    rel = np.abs(rstd_a.astype(np.float64) - rstd_b) / np.abs(rstd_a.astype(np.float64))
    rel += 4 * 2.0**-24
    rel = rel.reshape(-1, 1).astype(np.float32)
    return _excess(a, b, lambda start, rows: np.abs(rows) * rel[start : start + len(rows)])


def _dx_excess(a, b) -> float:
    """dx's difference beyond one ulp, in units of ROW_NOISE float32 epsilons times the row's
    largest |dx|."""
    noise = ROW_NOISE * float(np.finfo(np.float32).eps)
    return _excess(a, b, lambda start, rows: noise * np.abs(rows).max(axis=1, keepdims=True))


def _dgamma_excess(a, b, dy, x, rstd) -> float:
    """Largest |a - b| beyond one ulp of dgamma's dtype, in units of the float32 summation
    error of m terms (sqrt(m) * 2 * eps32 times the sum of their magnitudes)."""
    k = x.shape[-1]
    dy2, x2, r = dy.reshape(-1, k), x.reshape(-1, k), rstd.reshape(-1, 1)
    rows = max(1, CHUNK // k)
    total = np.zeros(k, np.float64)
    for start in range(0, x2.shape[0], rows):
        part = np.abs(dy2[start : start + rows].astype(np.float32))
        part *= np.abs(x2[start : start + rows].astype(np.float32))
        part *= r[start : start + rows]
        total += part.sum(axis=0, dtype=np.float64)
    m = x2.shape[0]
    tol = 2 * math.sqrt(m) * float(np.finfo(np.float32).eps) * total
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ulp = np.spacing(np.abs(a).astype(a.dtype)).astype(np.float64)
    excess = (np.abs(a64 - b64) - ulp) / np.maximum(tol, np.finfo(np.float64).tiny)
    if np.isnan(excess).any():
        return math.inf
    return float(excess.max(initial=0.0))


def _times(excess: float) -> str:
    return f"{excess:.2g}x" if excess <= 1000 else ">1000x"


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def compare(old_out: dict, new_out: dict, extra: dict, x) -> tuple[str, bool]:
    """(check text, flagged) for one cell's outputs of the two builds."""
    if all(_same_bits(old_out[n], new_out[n]) for n in old_out):
        return "bit-equal", False
    notes, flagged = [], False
    for name in old_out:
        a, b = old_out[name], new_out[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            notes.append(f"FLAG {name} {b.dtype}{b.shape} vs {a.dtype}{a.shape}")
            flagged = True
            continue
        if _same_bits(a, b):
            continue
        ulps = max_ulps(a, b)
        if name == "h":  # x + residual rounded once: exact
            bad, text = True, f"h {ulps} ulp"
        elif name == "rstd":
            bad, text = not 0 <= ulps <= RSTD_ULPS, f"rstd {ulps} ulp"
        elif name == "dgamma":
            excess = _dgamma_excess(a, b, extra["dy"], x, extra["rstd"])
            bad, text = not excess <= 1.0, f"dgamma {_times(excess)} tol"
        else:
            excess = (
                _y_excess(a, b, old_out["rstd"], new_out["rstd"])
                if name == "y"
                else _dx_excess(a, b)
            )
            bad = ulps < 0 or (ulps > 1 and not excess <= 1.0)
            text = f"{name} {ulps} ulp" + (f" ({_times(excess)} tol)" if ulps > 1 else "")
        flagged |= bad
        notes.append(("FLAG " if bad else "") + text)
    return ", ".join(notes), flagged


# --------------------------------------------------------------------------- the grid


def cells_for(args) -> list:
    return [
        (shape, dtype, op)
        for shape in args.shapes
        for dtype in args.dtypes
        for op in args.ops
        if _wanted(args.only, shape, dtype, op)
    ]


def _wanted(only: list, shape: tuple, dtype: str, op: str) -> bool:
    """--only: within each kind of token (op, dtype, shape), the cell must match one given."""
    given = {"op": [], "dtype": [], "shape": []}
    for token in only:
        kind = "op" if token in OPS else "dtype" if token in DTYPES else "shape"
        given[kind].append(token)
    values = {"op": op, "dtype": dtype, "shape": shape_text(shape)}
    return all(not tokens or values[kind] in tokens for kind, tokens in given.items())


def run_grid(args, old, new, emit) -> list:
    """Time every cell; inputs are made once per (shape, dtype) and freed after it."""
    results, todo = [], cells_for(args)
    by_input = {}
    for shape, dtype, op in todo:
        by_input.setdefault((shape, dtype), []).append(op)
    seed = np.random.SeedSequence(args.seed)
    for (shape, dtype), ops in by_input.items():
        inp = Inputs(shape, DTYPES[dtype], np.random.default_rng(seed.spawn(1)[0]))
        for op in ops:
            calls, extra = make_calls(op, inp, old, new)
            for threads in args.threads:
                for core in (old, new):
                    core.set_num_threads(threads)
                cell = Cell(shape, dtype, op, threads, reps=args.reps)
                cell.check, cell.flagged = compare(calls["old"](), calls["new"](), extra, inp.x)
                cell.old_s, cell.new_s, cell.loops = time_pair(calls, args.reps)
                for _ in range(args.recheck):
                    if cell.ratio <= args.limit:
                        break
                    # A burst of other load can push one cell over; a real slowdown stays.
                    first = cell.ratio
                    cell.reps *= 3
                    cell.old_s, cell.new_s, cell.loops = time_pair(calls, cell.reps)
                    cell.check += f"; re-timed, first {first:.3f}"
                results.append(cell)
                emit(cell)
            del calls, extra
            gc.collect()
        del inp
        gc.collect()
    return results


# --------------------------------------------------------------------------- report


def geomean(values: list) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else math.nan


TABLE_HEAD = [
    "| shape | dtype | op | threads | old ms | new ms | new/old | check |",
    "|---|---|---|---:|---:|---:|---:|---|",
]


def table_row(cell: Cell, limit: float) -> str:
    mark = " **" if cell.ratio > limit else ""
    return (
        f"| {shape_text(cell.shape)} | {cell.dtype} | {cell.op} | {cell.threads} | "
        f"{_ms(cell.old_s)} | {_ms(cell.new_s)} | {cell.ratio:.3f}{mark} | {cell.check} |"
    )


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.4g}" if ms >= 0.01 else f"{ms:.2e}"


def summary_lines(cells: list, limit: float) -> list:
    if not cells:
        return ["no cells were timed"]
    lines = ["| threads | cells | geomean new/old | worst new/old |", "|---:|---:|---:|---:|"]
    for threads in sorted({c.threads for c in cells}):
        ratios = [c.ratio for c in cells if c.threads == threads]
        lines.append(f"| {threads} | {len(ratios)} | {geomean(ratios):.3f} | {max(ratios):.3f} |")
    ratios = [c.ratio for c in cells]
    lines.append(f"| all | {len(ratios)} | {geomean(ratios):.3f} | {max(ratios):.3f} |")
    worst = max(cells, key=lambda c: c.ratio)
    over = [c for c in cells if c.ratio > limit]
    flagged = [c for c in cells if c.flagged]
    lines += [
        "",
        f"- worst cell: {_cell_name(worst)} at {worst.ratio:.3f}",
        f"- cells above {limit:g}: {len(over)} of {len(cells)}"
        + (": " + "; ".join(f"{_cell_name(c)} {c.ratio:.3f}" for c in over) if over else ""),
        f"- cells whose outputs differ beyond tolerance: {len(flagged)}"
        + (": " + "; ".join(f"{_cell_name(c)} ({c.check})" for c in flagged) if flagged else ""),
    ]
    return lines


def _cell_name(cell: Cell) -> str:
    return f"{cell.op} {shape_text(cell.shape)} {cell.dtype} at {cell.threads} thr"


def header_lines(args, old, new, notes: list) -> list:
    omp = " ".join(f"{k}={os.environ[k]}" for k in OMP_ENV if k in os.environ)
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    lines = [
        f"- date: {when}; host CPU: {cpu_model()} ({os.cpu_count()} logical cores), "
        f"{platform.system()} {platform.machine()}",
        f"- old: {describe_build(core_path(old))}, ISA {old.isa()}",
        f"- new: {describe_build(core_path(new))}, ISA {new.isa()}",
        f"- versions: python {platform.python_version()}, numpy {np.__version__}, "
        f"ml_dtypes {ml_dtypes.__version__}; OpenMP env: {omp or 'unset'}",
        f"- threads {', '.join(map(str, args.threads))}; median of {args.reps} interleaved rounds "
        f"(old-new, new-old, ...) after warm-up, each sample looping a call for about "
        f"{SAMPLE_S * 1e3:g} ms; a cell above {args.limit:g} re-timed with 3x the rounds up to "
        f"{args.recheck} time(s); out= preallocated for each build; eps={EPS}",
        "- new/old below 1 means the new build is faster; check: outputs of the two builds "
        "compared (see `benchmarks/ab.py`)",
    ]
    return lines + [f"- note: {n}" for n in notes]


def write_csv(cells: list, path: str) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            ["shape", "dtype", "op", "threads", "old_ms", "new_ms", "new_over_old", "reps",
             "loops", "flagged", "check"]
        )  # fmt: skip
        for c in cells:
            writer.writerow(
                [shape_text(c.shape), c.dtype, c.op, c.threads, f"{c.old_s * 1e3:.6g}",
                 f"{c.new_s * 1e3:.6g}", f"{c.ratio:.4f}", c.reps, c.loops, int(c.flagged),
                 c.check]
            )  # fmt: skip


# --------------------------------------------------------------------------- command line


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python benchmarks/ab.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--old",
        default=DEFAULT_OLD if os.path.exists(DEFAULT_OLD) else None,
        help=f"the old build's _core*.so (default {DEFAULT_OLD} when it exists)",
    )
    parser.add_argument(
        "--new", help="the new build's _core*.so (default: rmsnorm._core of this checkout)"
    )
    parser.add_argument("--threads", default="1,2", help="comma list (default 1,2)")
    parser.add_argument(
        "--shapes", help="comma list like 8192x4096,1024x1x12288 (default: the benchmark's)"
    )
    parser.add_argument("--dtypes", default="fp32,bf16,fp16", help="comma list of fp32,bf16,fp16")
    parser.add_argument("--ops", default=",".join(OPS), help="comma list of fwd,bwd,add")
    parser.add_argument(
        "--only",
        default="",
        help="comma list of ops, dtypes and shapes a cell must match (within each kind, any "
        "one), e.g. fwd,bf16 or bwd,8192x4096,64x4096",
    )
    parser.add_argument("--reps", type=int, help="interleaved rounds per cell (default 11)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: shapes {','.join(map(shape_text, QUICK_SHAPES))}, 3 rounds",
    )
    parser.add_argument(
        "--isa", default=os.environ.get("RMSNORM_ISA") or None, help="kernel family for both"
    )
    parser.add_argument(
        "--limit", type=float, default=LIMIT, help=f"list cells above this (default {LIMIT})"
    )
    parser.add_argument(
        "--recheck",
        type=int,
        default=1,
        help="time a cell above --limit again, with three times the rounds, up to this many "
        "times (default 1; its last timing counts)",
    )
    parser.add_argument("--out", help="write the Markdown report here")
    parser.add_argument("--csv", help="write the cells as CSV here")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.old is None:
        parser.error("--old is required (no default old build found)")
    if args.quick:
        args.shapes = args.shapes or ",".join(map(shape_text, QUICK_SHAPES))
    args.reps = args.reps or (3 if args.quick else 11)
    args.shapes = [_shape_arg(s) for s in args.shapes.split(",")] if args.shapes else ALL_SHAPES
    args.dtypes = args.dtypes.split(",")
    args.ops = args.ops.split(",")
    args.only = [t for t in args.only.split(",") if t]
    args.threads = [int(t) for t in args.threads.split(",")]
    for what, given, allowed in (("dtype", args.dtypes, DTYPES), ("op", args.ops, OPS)):
        unknown = [g for g in given if g not in allowed]
        if unknown:
            parser.error(f"unknown {what} {unknown}; choose from {list(allowed)}")
    if args.reps < 1 or min(args.threads) < 1 or args.recheck < 0:
        parser.error("--reps and --threads must be >= 1, --recheck >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rms_ab_") as scratch:
        old, new, notes = load_builds(args, scratch)
        if args.isa:
            for core in (old, new):
                core.set_isa(args.isa)
        head = header_lines(args, old, new, notes)
        print("\n".join(["# rmsnorm A/B: new build over old", "", *head, "", *TABLE_HEAD]))
        sys.stdout.flush()

        def emit(cell: Cell) -> None:
            print(table_row(cell, args.limit), flush=True)

        cells = run_grid(args, old, new, emit)
    summary = summary_lines(cells, args.limit)
    print("\n" + "\n".join(summary))
    if args.out:
        with open(args.out, "w") as handle:
            body = [table_row(c, args.limit) for c in cells]
            text = ["# rmsnorm A/B: new build over old", "", *head, "", "## Summary", ""]
            text += [*summary, "", "## Cells", "", *TABLE_HEAD, *body, ""]
            handle.write("\n".join(text))
        print(f"# wrote {args.out}", file=sys.stderr)
    if args.csv:
        write_csv(cells, args.csv)
        print(f"# wrote {args.csv}", file=sys.stderr)
    return 1 if any(c.flagged for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
