"""Normalizes a zarr array on disk into another zarr array, chunk by chunk, with rmsnorm.dask:
neither array is ever whole in memory (each task holds one block of rows of x and of y).

    python examples/zarr_rmsnorm.py SOURCE.zarr TARGET.zarr [--workers N]
    python examples/zarr_rmsnorm.py --demo DIR      (makes a small SOURCE in DIR first)

SOURCE's rows are normalized over its last axis with a weight of ones; TARGET gets SOURCE's
shape, dtype and chunks, and rstd goes to TARGET/../rstd.zarr. With --workers the work runs on a
dask.distributed LocalCluster of that many worker processes, else on the threaded scheduler.
"""

import argparse
import os

import dask
import dask.array as da
import numpy as np
import zarr

import rmsnorm.dask as rd


def normalize(source, target, rstd_target):
    x = da.from_zarr(source)
    gamma = np.ones(x.shape[-1], x.dtype)
    y, rstd = rd.rms_norm(x, gamma)
    # to_zarr writes each block as its task finishes; compute=False lets both stores share
    # one pass over x.
    dask.compute(
        da.to_zarr(y, target, overwrite=True, compute=False),
        da.to_zarr(rstd, rstd_target, overwrite=True, compute=False),
    )


def make_demo(directory):
    source = os.path.join(directory, "x.zarr")
    rows, k = 4096, 1024
    x = zarr.open_array(source, mode="w", shape=(rows, k), chunks=(512, k), dtype="float32")
    rng = np.random.default_rng(0)
    for start in range(0, rows, 512):
        x[start : start + 512] = rng.standard_normal((512, k), np.float32)
    return source, os.path.join(directory, "y.zarr")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="?")
    parser.add_argument("target", nargs="?")
    parser.add_argument("--demo", metavar="DIR", help="make a small source array in DIR")
    parser.add_argument("--workers", type=int, default=0, help="LocalCluster worker processes")
    args = parser.parse_args()
    if args.demo:
        args.source, args.target = make_demo(args.demo)
    if not args.source or not args.target:
        parser.error("give SOURCE and TARGET, or --demo DIR")
    rstd_target = os.path.join(os.path.dirname(os.path.abspath(args.target)), "rstd.zarr")
    if args.workers:
        from distributed import Client, LocalCluster

        with LocalCluster(n_workers=args.workers, threads_per_worker=1) as cluster:
            with Client(cluster):
                normalize(args.source, args.target, rstd_target)
    else:
        with dask.config.set(scheduler="threads"):
            normalize(args.source, args.target, rstd_target)
    y = zarr.open_array(args.target, mode="r")
    print(f"{args.target}: {y.shape} {y.dtype}, chunks {y.chunks}; rstd in {rstd_target}")


if __name__ == "__main__":
    main()
