# rmsnorm.torch under torch.distributed: DDP and FSDP2 (fully_shard) training steps of a small
# model with rmsnorm.torch.RMSNorm on two gloo processes give the single-process gradients, and
# DTensor inputs sharded on a leading axis run locally (no collective), dweight left Partial.
# The same file is the worker: `python test_torch_distributed.py RANK WORLD INIT OUT`; both
# processes run every scenario once, in one process group, to bound the time spent starting.
import importlib
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
rt = importlib.import_module("rmsnorm.torch")

if __name__ != "__main__":
    import oracle  # tests/ is on sys.path (conftest)

if not torch.distributed.is_available():  # pragma: no cover - builds without distributed
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORLD = 2
HIDDEN = 16
BATCH = 8
# Each process is bounded, so that a hung collective fails the test instead of the CI job.
TIMEOUT_S = 180


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, HIDDEN, dtype=dtype),
        rt.RMSNorm(HIDDEN, eps=1e-5, dtype=dtype),
        torch.nn.Linear(HIDDEN, HIDDEN, dtype=dtype),
        rt.RMSNorm(HIDDEN, eps=1e-5, offset=1.0, cast="before_weight", dtype=dtype),
        torch.nn.Linear(HIDDEN, 4, dtype=dtype),
    )
    with torch.no_grad():
        for module in (model[1], model[3]):
            module.weight.normal_(0.0, 0.5)
    return model


def make_batch(dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, HIDDEN, generator=gen, dtype=dtype)


def loss_of(model, x):
    return model(x).pow(2).sum(-1).mean()


def single_process_grads():
    model = make_model()
    loss_of(model, make_batch()).backward()
    return {name: p.grad for name, p in model.named_parameters()}


# --- the worker side -------------------------------------------------------------------------


def _local_rows(x, rank):
    per = x.shape[0] // WORLD
    return x[rank * per : (rank + 1) * per]


def worker_ddp(rank):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(make_model())
    loss_of(model, _local_rows(make_batch(), rank)).backward()
    return {name.removeprefix("module."): p.grad for name, p in model.named_parameters()}


def worker_fsdp(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = make_model()
    for module in model:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    loss_of(model, _local_rows(make_batch(), rank)).backward()
    # Sharded gradients (DTensors): gather the full ones to compare.
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}


def worker_dtensor(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (WORLD,))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 6, HIDDEN, generator=gen)
    residual = torch.randn(4, 6, HIDDEN, generator=gen)
    weight = 1 + 0.5 * torch.randn(HIDDEN, generator=gen)
    dy = torch.randn(4, 6, HIDDEN, generator=gen)
    dh = torch.randn(4, 6, HIDDEN, generator=gen)
    results = {}
    for dim in (0, 1):  # batch and sequence shards
        dx_ = distribute_tensor(x, mesh, [Shard(dim)]).requires_grad_()
        dr_ = distribute_tensor(residual, mesh, [Shard(dim)]).requires_grad_()
        dw_ = distribute_tensor(weight, mesh, [Replicate()]).requires_grad_()
        ddy = distribute_tensor(dy, mesh, [Shard(dim)])
        ddh = distribute_tensor(dh, mesh, [Shard(dim)])
        comms = CommDebugMode()
        with comms:
            y = rt.rms_norm(dx_, HIDDEN, dw_, 1e-6, offset=0.5)
            y2, h = rt.add_rms_norm(dx_, dr_, HIDDEN, dw_, 1e-6, cast="before_weight")
            assert y.placements == (Shard(dim),), y.placements
            assert y2.placements == (Shard(dim),) and h.placements == (Shard(dim),)
            torch.autograd.backward([y, y2, h], [ddy, ddy, ddh])
            assert dw_.grad.placements == (Partial(),), dw_.grad.placements
            assert dx_.grad.placements == (Shard(dim),), dx_.grad.placements
        assert comms.get_total_counts() == 0, comms.get_comm_counts()
        results[f"shard{dim}"] = {
            "y": y.full_tensor(),
            "y2": y2.full_tensor(),
            "h": h.full_tensor(),
            "dx": dx_.grad.full_tensor(),
            "dresidual": dr_.grad.full_tensor(),
            "dweight": dw_.grad.full_tensor(),
        }
    results["inputs"] = {"x": x, "residual": residual, "weight": weight, "dy": dy, "dh": dh}
    return results


SCENARIOS = {"ddp": worker_ddp, "fsdp": worker_fsdp, "dtensor": worker_dtensor}


def worker_main(rank, world, init_file, out_file):
    import rmsnorm

    torch.set_num_threads(1)
    rmsnorm.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    try:
        torch.save({name: run(rank) for name, run in SCENARIOS.items()}, out_file)
    finally:
        torch.distributed.destroy_process_group()


# --- the test side ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    """Runs WORLD worker processes of this file; returns each rank's saved results."""
    tmp_path = tmp_path_factory.mktemp("distributed")
    env = dict(os.environ, OMP_NUM_THREADS="1", RMSNORM_NUM_THREADS="1")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    init_file = tmp_path / "rendezvous"
    outs = [tmp_path / f"rank{r}.pt" for r in range(WORLD)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), str(WORLD), str(init_file), str(outs[r])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(WORLD)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed ({p.returncode}):\n{logs[r][-4000:]}"
    return [torch.load(o) for o in outs]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_data_parallel_grads_equal_single_process(mode, rank_results):
    expected = single_process_grads()
    for rank, results in enumerate(rank_results):
        grads = results[mode]
        assert set(grads) == set(expected)
        for name, want in expected.items():
            # The ranks sum half-batch gradients in another order than the single process:
            # float32 rounding, a few ulps of the largest element.
            scale = want.abs().max().item()
            torch.testing.assert_close(
                grads[name], want, rtol=1e-5, atol=1e-6 * scale, msg=f"rank {rank} {name}"
            )


def test_dtensor_leading_axis_shards_run_locally(rank_results):
    """The workers assert that no collective ran and the placements (dweight Partial); here
    the gathered results are checked against the float64 oracle."""
    for results in rank_results:
        result = results["dtensor"]
        inp = {k: v.numpy().astype(np.float64) for k, v in result["inputs"].items()}
        x, res, w, dy, dh = (inp[k] for k in ("x", "residual", "weight", "dy", "dh"))
        y_f64 = oracle.forward(x.astype(np.float32), w.astype(np.float32), 1e-6, 0.5)[0]
        h, y2_f64 = oracle.add_rms_norm(
            x.astype(np.float32),
            res.astype(np.float32),
            w.astype(np.float32),
            1e-6,
            cast="before_weight",
        )[:2]
        # dx and dweight: backward of y (offset 0.5 on x) plus backward of y2 (on h).
        dx1, dw1, s1, a1 = oracle.backward(dy, x, w, offset=0.5, eps=1e-6)
        dx2, dw2, s2, a2 = oracle.backward(dy, oracle.as_f64(h), w, eps=1e-6)
        for shard in ("shard0", "shard1"):
            got = {k: v.detach().numpy() for k, v in result[shard].items()}
            oracle.assert_y_close(got["y"], y_f64, 2)
            oracle.assert_y_close(got["y2"], y2_f64, 2)
            np.testing.assert_array_equal(got["h"], h)
            oracle.assert_dx_close(got["dx"], dx1 + dx2 + dh, s1 + s2 + np.abs(dh), np.float32)
            oracle.assert_dx_close(got["dresidual"], dx2 + dh, s2 + np.abs(dh), np.float32)
            oracle.assert_dgamma_close(got["dweight"], dw1 + dw2, a1 + a2, np.float32, np.float32)


if __name__ == "__main__":
    worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
