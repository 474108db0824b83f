"""Throughput of rmsnorm.dask on a LocalCluster of 1, 2, ... worker processes against one
rmsnorm.rms_norm call on the same float32 array in this process.

    python benchmarks/dask_bench.py [--gib 4] [--workers 1,2] [--k 4096] [--chunk-mib 64]

GB/s counts x read and y and rstd written once. The single call runs on all of this process's
kernel threads (rmsnorm.get_num_threads()), into a preallocated y (the ratios' base) and
allocating y. Each cluster gets the machine's cores split among
its workers (threads_per_worker = cores // workers; one kernel thread per task, rmsnorm.dask's
default on a worker), holds x in its workers' memory (made there, chunk by chunk, before the
clock starts) and keeps y and rstd there (persisted, not gathered), so the figures are those of
the normalization and of Dask's scheduling, not of moving the data to the client. The threaded
scheduler in this process is measured too (no worker processes, no serialization).

Where dask.distributed cannot be imported, the benchmark says so and measures Dask's
multiprocessing scheduler instead (each chunk is pickled to a worker process and y back to this
one, so it measures that transfer as much as the kernels) beside the threaded one.
"""

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

import rmsnorm

try:
    import dask
    import dask.array as da
except ImportError:
    sys.exit("dask_bench.py needs dask: pip install 'dask[array]' (and distributed)")

import rmsnorm.dask as rd

try:
    import distributed
except ImportError as exc:  # run on with the schedulers that come with dask itself
    distributed = None
    NO_DISTRIBUTED = f"{type(exc).__name__}: {exc}"


def median_seconds(run, repeats, after=lambda result: None):
    """Median time of ``run()``; ``after(result)``, untimed, follows each run."""
    after(run())  # warm-up: page faults, worker imports, first graph
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
        after(result)
    return statistics.median(times)


def make_x(rows, k, chunk_rows, seed=0):
    """float32 rows of k, filled chunk by chunk (no float64 array of the whole size)."""
    x = np.empty((rows, k), np.float32)
    rng = np.random.default_rng(seed)
    for start in range(0, rows, chunk_rows):
        stop = min(rows, start + chunk_rows)
        x[start:stop] = rng.standard_normal((stop - start, k), np.float32)
    return x


def single_call(rows, k, chunk_rows, gamma, repeats):
    """Seconds of one call into a preallocated y (the kernels alone), and of one that
    allocates y (as the tasks of the cluster do: a fresh array's pages are faulted in)."""
    x = make_x(rows, k, chunk_rows)
    into = median_seconds(lambda y=np.empty_like(x): rmsnorm.rms_norm(x, gamma, out=y), repeats)
    allocating = median_seconds(lambda: rmsnorm.rms_norm(x, gamma), repeats)
    return into, allocating


def on_cluster(workers, rows, k, chunk_rows, gamma, repeats, cores):
    from distributed import Client, LocalCluster, wait

    with (
        LocalCluster(
            n_workers=workers,
            threads_per_worker=max(1, cores // workers),
            processes=True,
            memory_limit=0,
            dashboard_address=None,
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(workers, timeout=300)
        x = da.random.default_rng(0).standard_normal(
            (rows, k), chunks=(chunk_rows, k), dtype=np.float32
        )
        x = x.persist()
        wait(x)

        def run():
            done = client.persist(list(rd.rms_norm(x, gamma)))
            wait(done)
            # The futures go with this frame: the workers drop the results (untimed, below).
            return [key for array in done for key in dask.core.flatten(array.__dask_keys__())]

        def release(keys):
            # The next run builds the same keys: it must not find these results still held.
            while not client.run_on_scheduler(_released, keys=keys):
                time.sleep(0.01)

        return median_seconds(run, repeats, release)


def _released(keys, dask_scheduler=None):
    return not any(key in dask_scheduler.tasks for key in keys)


def in_process(scheduler, workers, rows, k, chunk_rows, gamma, repeats):
    x = make_x(rows, k, chunk_rows)
    # One graph key per chunk: a worker process is sent its chunk, not the whole array.
    xs = da.concatenate(
        [da.from_array(x[i : i + chunk_rows], chunks=-1) for i in range(0, rows, chunk_rows)]
    )
    extra = {}
    if scheduler == "processes":  # one pool for every run: not its start-up each time
        import concurrent.futures

        extra["pool"] = concurrent.futures.ProcessPoolExecutor(workers)

    def run():
        y, rstd = rd.rms_norm(xs, gamma)
        # persist: the results stay in chunks, as on the cluster (compute would concatenate)
        dask.persist(y, rstd, scheduler=scheduler, num_workers=workers, **extra)

    try:
        return median_seconds(run, repeats)
    finally:
        if extra:
            extra["pool"].shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="size of x in GiB (default 4)")
    parser.add_argument("--workers", default="1,2", help="worker processes, comma-separated")
    parser.add_argument("--k", type=int, default=4096, help="row length (default 4096)")
    parser.add_argument("--chunk-mib", type=float, default=64.0, help="MiB per chunk of x")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure")
    args = parser.parse_args()

    cores = os.cpu_count() or 1
    k = args.k
    rows = max(1, int(args.gib * 2**30) // (4 * k))
    chunk_rows = max(1, min(rows, int(args.chunk_mib * 2**20) // (4 * k)))
    gamma = np.random.default_rng(1).uniform(0.5, 1.5, k).astype(np.float32)
    moved = rows * k * 4 * 2 + rows * 4  # x read, y and rstd written
    workers = [int(w) for w in args.workers.split(",")]

    print(
        f"# rmsnorm.dask vs one rmsnorm.rms_norm call; {platform.processor() or platform.machine()}"
    )
    print(
        f"# cores {cores}, python {platform.python_version()}, numpy {np.__version__}, "
        f"dask {dask.__version__}, distributed "
        f"{distributed.__version__ if distributed else 'missing'}, rmsnorm isa {rmsnorm.isa()}, "
        f"kernel threads of the single call {rmsnorm.get_num_threads()}"
    )
    print(
        f"# x: float32 ({rows}, {k}) = {rows * k * 4 / 2**30:.2f} GiB in "
        f"{-(-rows // chunk_rows)} chunks of {chunk_rows} rows; median of {args.repeats}"
    )
    if distributed is None:
        print(f"# dask.distributed unavailable ({NO_DISTRIBUTED}): the multiprocessing scheduler")
        print("# stands in for the cluster (chunks pickled to worker processes and back)")

    base, allocating = single_call(rows, k, chunk_rows, gamma, args.repeats)
    results = [
        ("one rmsnorm.rms_norm call, out=y", base),
        ("one rmsnorm.rms_norm call, y allocated", allocating),
    ]
    for n in workers:
        if distributed is not None:
            label = f"dask LocalCluster, {n} worker process{'es' * (n > 1)}"
            seconds = on_cluster(n, rows, k, chunk_rows, gamma, args.repeats, cores)
        else:
            label = f"dask processes scheduler, {n} process{'es' * (n > 1)}"
            seconds = in_process("processes", n, rows, k, chunk_rows, gamma, args.repeats)
        results.append((label, seconds))
    threaded = in_process("threads", cores, rows, k, chunk_rows, gamma, args.repeats)
    results.append((f"dask threaded scheduler, {cores} threads", threaded))

    print(f"{'what':<44} {'seconds':>9} {'GB/s':>8} {'vs single':>10}")
    for label, seconds in results:
        print(f"{label:<44} {seconds:9.3f} {moved / seconds / 1e9:8.2f} {base / seconds:10.2f}")


if __name__ == "__main__":
    main()
