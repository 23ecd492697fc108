"""Why one fp32 GEMV streams 25-30 GB/s on one machine and ~13 on another: the suspects, one at a time.

Run: nice -n 19 .venv/bin/python -m bench.gemv_bandwidth [--runs 7]

Each line is the median over --runs passes of kernels.linear.MatVec (or a variant) over a set of
(F, E) = (1536, 576) fp32 matrices, SmolLM2's gate shape:
  * hot: one 3.5 MB matrix, read again and again (it stays in the 32 MB L3);
  * cold: 96 different matrices (340 MB, 10x the L3) read in turn, as a decode step reads 30
    layers' weights;
  * misaligned: the cold set, each matrix starting 4 bytes after a 64-byte boundary;
  * no fastmath: the same four-row loop compiled without "reassoc" (LLVM cannot vectorise the sums);
  * 2 threads: kernels.set_threads(2) (numba's threading layer is printed);
  * a plain streaming read (numpy sum over the cold set) for the memory system's own number.
GB/s counts the matrices' bytes; "cpu" columns use this thread's CPU time (1 thread only), which
leaves out time the scheduler gave to other processes on a shared machine.
"""
from __future__ import annotations

import argparse
import os
import time

import numba
import numpy as np
from numba import njit

import kernels
from bench.quant_speed import median_seconds
from kernels.linear import ROWS, MatVec

SHAPE = (1536, 576)  # (F, E): SmolLM2's ffn gate / up
COLD_COUNT = 96  # matrices in the cold set: ~340 MB, ten times the 32 MB L3 of this CPU
ALIGN = 64  # bytes: a cache line


@njit(cache=True)
def _matvec_strict(weight, x, out):
    """kernels.linear's four-row loop without fastmath: the sums stay in order, so stay scalar."""
    rows, cols = weight.shape
    for i in range(0, rows - rows % ROWS, ROWS):
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for j in range(cols):
            xj = x[j]
            a0 += weight[i, j] * xj
            a1 += weight[i + 1, j] * xj
            a2 += weight[i + 2, j] * xj
            a3 += weight[i + 3, j] * xj
        out[i], out[i + 1], out[i + 2], out[i + 3] = a0, a1, a2, a3


def aligned_matrices(count: int, offset: int, rng) -> list[np.ndarray]:
    """count (F, E) fp32 matrices, each starting `offset` bytes after a 64-byte boundary."""
    size = SHAPE[0] * SHAPE[1] * 4
    mats = []
    for _ in range(count):
        raw = np.empty(size + 2 * ALIGN, np.uint8)
        start = (-raw.ctypes.data) % ALIGN + offset
        mat = raw[start:start + size].view(np.float32).reshape(SHAPE)  # (F, E)
        mat[...] = rng.standard_normal(SHAPE, dtype=np.float32)
        mats.append(mat)
    return mats


def pass_seconds(calls, runs: int, clock) -> float:
    """Median seconds of one pass over `calls` (one warm-up pass first)."""
    return median_seconds(calls, runs, clock) * len(calls)


def report(label: str, calls, nbytes: int, runs: int, cpu: bool = True) -> None:
    wall = pass_seconds(calls, runs, time.perf_counter)
    line = f"{label:34s} wall {nbytes / wall / 1e9:6.1f} GB/s"
    if cpu:
        line += f"   cpu {nbytes / pass_seconds(calls, runs, time.thread_time) / 1e9:6.1f} GB/s"
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal(SHAPE[1]).astype(np.float32)  # (E,)
    out = np.empty(SHAPE[0], np.float32)  # (F,)
    cold = aligned_matrices(COLD_COUNT, 0, rng)
    odd = aligned_matrices(COLD_COUNT, 4, rng)
    one = cold[0].nbytes
    print(f"load average {os.getloadavg()[0]:.2f}; affinity {sorted(os.sched_getaffinity(0))}; "
          f"NUMBA_NUM_THREADS {numba.config.NUMBA_NUM_THREADS}; median of {args.runs} passes")
    hot = [MatVec(cold[0])] * COLD_COUNT
    report("hot (one matrix, L3-resident)", [lambda m=m: m(x, out) for m in hot], one * COLD_COUNT, args.runs)
    report("cold (96 matrices, 340 MB)", [lambda m=MatVec(w): m(x, out) for w in cold], one * COLD_COUNT, args.runs)
    report("cold, misaligned by 4 B", [lambda m=MatVec(w): m(x, out) for w in odd], one * COLD_COUNT, args.runs)
    report("cold, no fastmath (scalar sums)", [lambda w=w: _matvec_strict(w, x, out) for w in cold],
           one * COLD_COUNT, args.runs)
    report("cold, numpy sum (streaming read)", [lambda w=w: w.sum() for w in cold], one * COLD_COUNT, args.runs)
    kernels.set_threads(2)
    try:
        report("cold, 2 threads", [lambda m=MatVec(w): m(x, out) for w in cold], one * COLD_COUNT, args.runs, cpu=False)
        print(f"numba threading layer: {numba.threading_layer()}")
    finally:
        kernels.set_threads(1)


if __name__ == "__main__":
    main()
