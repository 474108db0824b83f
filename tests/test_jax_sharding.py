# rmsnorm.jax on arrays sharded over a mesh of two CPU devices (a subprocess with
# --xla_force_host_platform_device_count=2): y, h, dx and dweight match the plain jnp formula,
# and the compiled HLO of batch-sharded inputs holds no all-gather. Run as a script, this file is
# that subprocess: it saves ours and the reference's results and what the HLO holds.
import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

# (id, x shape, weight shape or None, PartitionSpec entries of x, offset, dtype)
CASES = [
    ("rows", (8, 6, 32), (32,), ("d",), 0.0, "float32"),
    ("bf16_offset", (16, 64), (64,), ("d",), 1.0, "bfloat16"),
    ("2d_weight_second_axis", (4, 6, 8, 16), (8, 16), (None, "d"), 0.0, "float32"),
    ("no_weight", (8, 32), None, ("d",), 0.0, "float32"),
    ("normalized_axis", (8, 32), (32,), (None, "d"), 0.0, "float32"),
]
VARIANTS = ["auto-ffi", "explicit-ffi", "auto-callback", "explicit-callback"]


def save(path, got, want):
    """Results as float64 (exact for every dtype here) with their dtypes' names: np.load
    cannot give bfloat16 back."""
    arrays = {}
    for prefix, results in (("got", got), ("want", want)):
        for i, a in enumerate(results):
            arrays[f"{prefix}{i}"] = np.asarray(a).astype(np.float64)
            arrays[f"{prefix}{i}_dtype"] = np.array(str(a.dtype))
    np.savez(path, **arrays)


def run_cases(out_dir, axis_type):
    """Computes every case on the two-device mesh and saves the results (the subprocess)."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import rmsnorm.jax as rj

    assert len(jax.devices()) == 2
    mesh = jax.make_mesh((2,), ("d",), axis_types=(getattr(AxisType, axis_type),))
    report = {"backend": rj.BACKEND}

    def reference(x, weight, offset):
        xf = x.astype(jnp.float32)
        axes = tuple(range(x.ndim - (1 if weight is None else weight.ndim), x.ndim))
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=axes, keepdims=True) + 1e-6)
        if weight is not None:
            y = y * (offset + weight.astype(jnp.float32))
        return y.astype(x.dtype)

    def hlo(fn, *args):
        return fn.lower(*args).compile().as_text()

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, P(*spec)))

    for name, shape, weight_shape, spec, offset, dtype in CASES:
        dtype = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
        rng = np.random.default_rng(0)
        x = rng.standard_normal(shape).astype(dtype)
        weight = None if weight_shape is None else rng.uniform(0.5, 1.5, weight_shape)
        weight = None if weight is None else weight.astype(dtype)
        dy = rng.standard_normal(shape).astype(dtype)
        xs, dys = put(x, spec), put(dy, spec)

        def ours(x, w, offset=offset):
            return rj.rms_norm(x, w, 1e-6, offset)

        def theirs(x, w, offset=offset):
            return reference(x, w, offset)

        def loss(fn):
            return lambda x, w, dy: jnp.sum(fn(x, w).astype(jnp.float32) * dy)

        argnums = (0,) if weight is None else (0, 1)
        forward = jax.jit(ours)
        grad = jax.jit(jax.grad(loss(ours), argnums))
        y = forward(xs, weight)
        grads = grad(xs, weight, dys)
        want = (
            jax.jit(theirs)(x, weight),
            *jax.jit(jax.grad(loss(theirs), argnums))(x, weight, dy),
        )
        got = (y, *grads)
        save(os.path.join(out_dir, f"{name}-{axis_type}.npz"), got, want)
        report[name] = {
            "forward_all_gather": "all-gather" in hlo(forward, xs, weight),
            "grad_all_gather": "all-gather" in hlo(grad, xs, weight, dys),
            "grad_all_reduce": "all-reduce" in hlo(grad, xs, weight, dys),
            "y_spec": str(getattr(y.sharding, "spec", y.sharding)),
            "dweight_spec": None
            if weight is None
            else str(getattr(grads[1].sharding, "spec", grads[1].sharding)),
        }

    # The fused add, and vmap with a shared weight, on batch-sharded inputs.
    rng = np.random.default_rng(1)
    x, residual, dy, dh = (rng.standard_normal((8, 6, 32)).astype(np.float32) for _ in range(4))
    weight = rng.uniform(0.5, 1.5, 32).astype(np.float32)
    sharded = [put(a, ("d",)) for a in (x, residual, dy, dh)]

    def add_loss(fn):
        def f(x, r, w, dy, dh):
            y, h = fn(x, r, w)
            return jnp.sum(y * dy) + jnp.sum(h * dh)

        return f

    def add_reference(x, r, w):
        h = x + r
        return reference(h, w, 0.0), h

    add_grad = jax.jit(jax.grad(add_loss(rj.add_rms_norm), (0, 1, 2)))
    add_forward = jax.jit(rj.add_rms_norm)
    args = (sharded[0], sharded[1], weight)
    got = (*add_forward(*args), *add_grad(*args, *sharded[2:]))
    want = (
        *add_reference(x, residual, weight),
        *jax.grad(add_loss(add_reference), (0, 1, 2))(x, residual, weight, dy, dh),
    )
    vmapped = jax.jit(jax.vmap(lambda x, w: rj.rms_norm(x, w), in_axes=(0, None)))
    per_example = jax.jit(jax.vmap(jax.grad(loss(ours), (0, 1)), in_axes=(0, None, 0)))
    got += (vmapped(sharded[0], weight), *per_example(sharded[0], weight, sharded[2]))
    want += (
        reference(x, weight, 0.0),
        *jax.vmap(jax.grad(loss(theirs), (0, 1)), in_axes=(0, None, 0))(x, weight, dy),
    )
    save(os.path.join(out_dir, f"add_and_vmap-{axis_type}.npz"), got, want)
    report["add_and_vmap"] = {
        "forward_all_gather": "all-gather" in hlo(add_forward, *args),
        "grad_all_gather": "all-gather" in hlo(add_grad, *args, *sharded[2:]),
        "vmap_all_gather": "all-gather" in hlo(vmapped, sharded[0], weight),
    }
    with open(os.path.join(out_dir, f"report-{axis_type}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    run_cases(sys.argv[1], sys.argv[2])
    sys.exit(0)

pytest.importorskip("jax")
ml_dtypes = pytest.importorskip("ml_dtypes")
test_jax = importlib.import_module("test_jax")


@pytest.fixture(scope="module", params=VARIANTS)
def results(request, tmp_path_factory):
    """Runs this file as a script on two CPU devices, once per variant: the mesh's axis type
    (Auto: custom_partitioning; Explicit: shard_map) and the backend (FFI or pure_callback)."""
    axis_type, backend = request.param.split("-")
    out = tmp_path_factory.mktemp(request.param)
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()
    env["RMSNORM_JAX_FFI"] = "1" if backend == "ffi" else "0"
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run(
        [sys.executable, __file__, str(out), axis_type.capitalize()],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    with open(out / f"report-{axis_type.capitalize()}.json") as f:
        report = json.load(f)
    expected_backend = "ffi" if backend == "ffi" else "callback"
    if backend == "ffi" and report["backend"] != "ffi":
        pytest.skip("the FFI backend could not be built here")
    assert report["backend"] == expected_backend
    # Host callbacks cannot run inside XLA's custom partitioning: with Auto axes the
    # pure_callback backend takes XLA's gathered route (still correct).
    per_shard = request.param != "auto-callback"
    return out, axis_type.capitalize(), report, per_shard


def arrays(results, name):
    out, axis_type = results[:2]
    data = np.load(out / f"{name}-{axis_type}.npz")

    def load(key):
        return data[key].astype(
            np.dtype(
                getattr(ml_dtypes, str(data[f"{key}_dtype"]), None) or str(data[f"{key}_dtype"])
            )
        )

    count = len(data.files) // 4
    return [(load(f"got{i}"), load(f"want{i}")) for i in range(count)]


def assert_matches(pairs):
    for got, want in pairs:
        test_jax.assert_close(got, want)


@pytest.mark.parametrize("case", [c[0] for c in CASES if c[0] != "normalized_axis"])
def test_batch_sharded_inputs_run_per_shard(results, case):
    """y, dx and dweight match the jnp formula; no all-gather in the compiled forward or
    gradient; y keeps x's sharding and dweight is replicated (summed across the devices)."""
    assert_matches(arrays(results, case))
    report = results[2][case]
    if not results[3]:
        return
    assert not report["forward_all_gather"]
    assert not report["grad_all_gather"]
    assert "'d'" in report["y_spec"]
    if report["dweight_spec"] is not None:
        assert report["grad_all_reduce"]  # the psum of dweight
        assert "'d'" not in report["dweight_spec"]


def test_sharded_normalized_axis_is_gathered_and_correct(results):
    """Sharding along the normalized axis gives the right result: XLA gathers the rows whole
    before the kernels run (the documented behaviour)."""
    assert_matches(arrays(results, "normalized_axis"))
    assert results[2]["normalized_axis"]["forward_all_gather"]


def test_add_rms_norm_and_vmap_on_sharded_inputs(results):
    """add_rms_norm's y, h and gradients (x, residual, weight), a vmap with a shared weight
    and per-example gradients under vmap, all on batch-sharded inputs."""
    pairs = arrays(results, "add_and_vmap")
    assert len(pairs) == 8
    assert_matches(pairs)
    report = results[2]["add_and_vmap"]
    if not results[3]:
        return
    assert not report["forward_all_gather"]
    assert not report["grad_all_gather"]
    assert not report["vmap_all_gather"]
