"""Can one persistent kernel stream a decoder layer's weights at the memory's rate, with a grid-wide
barrier between the layer's matmuls? (The question behind a whole-layer batch-1 kernel.)

At batch 1 a step is a chain of matrix-vector products (QKV, O, gate/up, down per layer), each a
kernel of its own today: every boundary drains the memory pipe, and the next kernel ramps it up
again (RESULTS.md, sessions 14-17: the GEMMs stream at 3.3-4.2 TB/s, and ~20 us per layer of small
kernels leave HBM idle). Weights never depend on activations, so one persistent program per SM can
keep copying its next weight tiles while it waits at a barrier for the previous product.

This benchmark times exactly that part, on Hopper (Pallas Mosaic GPU):
  - one program per SM; a copier warpgroup streams the SM's weight tiles, phase after phase, through
    a ring of `stages` shared-memory slots, never waiting for activations;
  - a compute warpgroup multiplies each [64, tile_k] weight tile by the activations (swapped
    operands: the weights are the wgmma's rows, up to 8 sequences its columns) and stores the tile's
    partial product; between phases it signals a global semaphore and waits for every SM's signal
    (`--barriers self none` price the waits).
The activations are one fixed [8, tile_k] slice for every phase (the products are independent), so
this is an upper bound for a real layer kernel: it leaves out reading the previous phase's output,
the norms, attention and the partial sums' reduction. Against it the same products as XLA's chain
(each product's output feeding the next) and a plain device copy of the same bytes, in the same run.

The real data flow between the products is `persistent_chain.py`'s.

  python benchmarks/persistent_gemv.py --layers 4 --tile-k 512 --stages 3 --barriers grid self none
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from common import non_negative_int, positive_int
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from kernels import cupti_us

from jengine.kernels_pallas.ragged_paged_attention import gpu_mosaic

ROWS = 64  # weight rows per tile: the wgmma's M
COLS = 8  # sequences: the wgmma's N
LAYER = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # [N, K] of QKV, O, gate/up, down (8B)


def tiled_smem(shape, dtype):
    swizzle = 128
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
                                                plgpu.SwizzleTransform(swizzle)))


def _bounds(num_tiles, sm, num_sms):
    """This SM's contiguous share [lo, hi) of a phase's tiles (k-block major)."""
    return (num_tiles * sm) // num_sms, (num_tiles * (sm + 1)) // num_sms


def _kernel(x_ref, *refs, shapes, tile_k, stages, num_sms, barrier):
    """barrier: "grid" (wait for every SM's signal), "near<k>" (wait for the signals of k SMs, this one
    and the next k - 1: what a product whose input blocks came from a few SMs would wait for), "self"
    (only this SM's own signal: the stores' drain and the atomics' round trip) or "none"."""
    phases = len(shapes)
    w_refs, y_refs = refs[:phases], refs[phases:2 * phases]
    w_smem, x_smem, o_smem, produced, consumed, x_bar = refs[2 * phases:]
    sm = lax.axis_index("sm")
    wg = lax.axis_index("wg")
    sems = pl.get_global(plgpu.SemaphoreType.REGULAR((phases,)))
    own = pl.get_global(plgpu.SemaphoreType.REGULAR((phases * num_sms,)))  # one per (phase, SM)
    tiles = [(n // ROWS) * (k // tile_k) for n, k in shapes]

    bounds = [_bounds(tiles[p], sm, num_sms) for p in range(phases)]

    def tile_ref(p, t):
        nblocks = shapes[p][0] // ROWS
        kb, nb = t // nblocks, lax.rem(t, nblocks)
        return w_refs[p].at[pl.ds(nb * ROWS, ROWS), pl.ds(kb * tile_k, tile_k)]

    @pl.when(wg == 1)
    def _copier():
        plgpu.set_max_registers(40, action="decrease")
        done = jnp.int32(0)
        for p in range(phases):
            lo, hi = bounds[p]

            @pl.loop(lo, hi)
            def _(t, p=p, lo=lo, done=done):
                g = done + t - lo
                slot = lax.rem(g, stages)
                pl.when(g >= stages)(lambda: plgpu.barrier_wait(consumed.at[slot]))
                plgpu.copy_gmem_to_smem(tile_ref(p, t), w_smem.at[slot], produced.at[slot])
            done = done + hi - lo

    @pl.when(wg == 0)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        plgpu.copy_gmem_to_smem(x_ref, x_smem, x_bar)
        plgpu.barrier_wait(x_bar)
        done = jnp.int32(0)
        for p, (n, _) in enumerate(shapes):
            lo, hi = bounds[p]
            nblocks = n // ROWS
            if barrier == "grid" and p > 0:
                plgpu.semaphore_wait(sems.at[p - 1], num_sms, decrement=False, memory_scope="gpu")
            elif barrier.startswith("near") and p > 0:
                for j in range(int(barrier[4:])):
                    other = (p - 1) * num_sms + lax.rem(sm + j, num_sms)
                    plgpu.semaphore_wait(own.at[other], 1, decrement=False, memory_scope="gpu")
            elif barrier == "self" and p > 0:
                plgpu.semaphore_wait(sems.at[p - 1], 1, decrement=False, memory_scope="gpu")

            @pl.loop(lo, hi)
            def _(t, p=p, lo=lo, nblocks=nblocks, done=done):
                g = done + t - lo
                slot = lax.rem(g, stages)
                plgpu.barrier_wait(produced.at[slot])

                def mm(acc_ref):
                    plgpu.wgmma(acc_ref, w_smem.at[slot], x_smem.transpose((1, 0)))
                    return acc_ref[...]
                acc = pl.run_scoped(mm, plgpu.ACC((ROWS, COLS), jnp.float32))
                plgpu.barrier_arrive(consumed.at[slot])
                kb, nb = t // nblocks, lax.rem(t, nblocks)
                out = lax.rem(g, 2)
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                o_smem.at[out][...] = acc
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[out], y_refs[p].at[kb, pl.ds(nb * ROWS, ROWS)])
            done = done + hi - lo
            plgpu.wait_smem_to_gmem(0)
            if barrier.startswith("near"):
                plgpu.semaphore_signal(own.at[p * num_sms + sm], 1, memory_scope="gpu")
            elif barrier != "none":
                plgpu.semaphore_signal(sems.at[p], 1, memory_scope="gpu")


def persistent_gemv(x, weights, *, tile_k=256, stages=6, barrier="grid", num_sms=None):
    """x: [8, tile_k] bf16 (every k-block's activations); weights: [N, K] bf16 each. Returns each
    phase's per-k-block partial products [K // tile_k, N, 8] f32 (sum axis 0 for x_full @ W^T)."""
    num_sms = num_sms or jax.devices()[0].core_count
    if barrier not in ("grid", "self", "none") and not (barrier.startswith("near") and barrier[4:].isdigit()
                                                         and 0 < int(barrier[4:]) <= num_sms):
        raise ValueError(f"persistent_gemv: barrier must be 'grid', 'near<k>' (k SMs), 'self' or 'none', "
                         f"got {barrier!r}")
    shapes = tuple(w.shape for w in weights)
    if any(w.dtype != jnp.bfloat16 for w in weights) or x.dtype != jnp.bfloat16 or x.shape != (COLS, tile_k):
        raise ValueError(f"persistent_gemv: weights and x must be bf16, x [{COLS}, {tile_k}]; got "
                         f"{sorted({str(w.dtype) for w in weights})} and {x.dtype}{list(x.shape)}")
    for n, k in shapes:
        if n % ROWS or k % tile_k:
            raise ValueError(f"persistent_gemv: weight [N, K] = {(n, k)} needs N % {ROWS} == 0 and K % {tile_k} == 0")
    out_type = [jax.ShapeDtypeStruct((k // tile_k, n, COLS), jnp.float32) for n, k in shapes]
    scratch = [tiled_smem((stages, ROWS, tile_k), jnp.bfloat16), tiled_smem((COLS, tile_k), jnp.bfloat16),
               plgpu.SMEM((2, ROWS, COLS), jnp.float32), plgpu.Barrier(num_barriers=stages),
               plgpu.Barrier(num_barriers=stages), plgpu.Barrier()]
    return plgpu.kernel(
        functools.partial(_kernel, shapes=shapes, tile_k=tile_k, stages=stages, num_sms=num_sms, barrier=barrier),
        out_type=out_type, scratch_types=scratch, grid=(num_sms,), grid_names=("sm",), num_threads=2,
        thread_name="wg")(x, *weights)


def xla_chain(x, weights):
    """The same products as XLA runs them in a model, each feeding the next: x [1, K0] bf16."""
    h = x
    for w in weights:
        k = w.shape[1]
        if h.shape[1] > k:  # gate/up -> down: a SwiGLU-like product of the halves
            h = h[:, :k] * h[:, k:2 * k] if h.shape[1] >= 2 * k else h[:, :k]
        y = lax.dot_general(h, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        h = y.astype(jnp.bfloat16)
    return h


def setup(layers):
    """The benchmark's random weights (`layers` x LAYER, bf16), a batch-1 input, the results dict and
    `report(name, seconds, extra)`, which prints a run and adds it to the results."""
    shapes = [s for _ in range(layers) for s in LAYER]
    keys = jax.random.split(jax.random.key(0), len(shapes) + 1)
    weights = [jax.random.normal(k, s, jnp.bfloat16) * 0.02 for k, s in zip(keys[1:], shapes)]
    nbytes = sum(w.size * 2 for w in weights)
    results = {"layers": layers, "weight_bytes": nbytes, "device": str(jax.devices()[0]), "runs": []}

    def report(name, seconds, extra=None):
        row = {"name": name, "us": seconds * 1e6, "us_per_layer": seconds * 1e6 / layers,
               "weight_TBps": nbytes / seconds / 1e12, **(extra or {})}
        results["runs"].append(row)
        print(f"{name:40s} {row['us']:9.1f} us  {row['us_per_layer']:7.1f} us/layer  {row['weight_TBps']:.2f} TB/s",
              flush=True)

    return weights, jax.random.normal(keys[0], (1, LAYER[0][1]), jnp.bfloat16), results, report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--tile-k", type=positive_int, nargs="+", default=[256])
    ap.add_argument("--stages", type=positive_int, nargs="+", default=[6])
    ap.add_argument("--num-sms", type=non_negative_int, nargs="+", default=[0],
                    help="programs (0: one per SM); 128 splits every 8B product evenly")
    ap.add_argument("--reps", type=positive_int, default=20)
    ap.add_argument("--barriers", nargs="+", default=["grid"],
                    help="grid: wait for every SM between products; near<k>: for k SMs; self: only for this "
                         "SM's own signal; none")
    ap.add_argument("--check", action="store_true", help="compare the products with jnp")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    bad = [b for b in args.barriers if b not in ("grid", "self", "none") and not re.fullmatch(r"near[1-9][0-9]*", b)]
    if bad:
        ap.error(f"--barriers: {bad[0]!r} is not grid, near<k>, self or none")
    if not gpu_mosaic.on_hopper():
        raise SystemExit(f"persistent_gemv.py needs a Hopper GPU (Pallas Mosaic GPU); this is "
                         f"{jax.devices()[0].device_kind}")

    weights, x1, results, report = setup(args.layers)
    nbytes = results["weight_bytes"]
    flat = jnp.concatenate([w.reshape(-1) for w in weights])
    copy = jax.jit(lambda a: a + jnp.bfloat16(1))
    t = cupti_us(copy, (flat,), args.reps) * 1e-6
    results["runs"].append({"name": "copy (read + write)", "us": t * 1e6, "TBps": 2 * nbytes / t / 1e12})
    print(f"{'copy (read + write)':40s} {t * 1e6:9.1f} us  {2 * nbytes / t / 1e12:.2f} TB/s of traffic", flush=True)
    del flat

    report("xla chain (batch 1)", cupti_us(jax.jit(xla_chain), (x1, weights), args.reps) * 1e-6)

    for tile_k in args.tile_k:
        xs = jax.random.normal(jax.random.key(1), (COLS, tile_k), jnp.bfloat16)
        for stages in args.stages:
            for barrier, sms in itertools.product(args.barriers, args.num_sms):
                name = f"persistent tile_k={tile_k} stages={stages} barrier={barrier} sms={sms or 'all'}"
                fn = jax.jit(functools.partial(persistent_gemv, tile_k=tile_k, stages=stages, barrier=barrier,
                                               num_sms=sms or None))
                try:
                    t = cupti_us(fn, (xs, weights), args.reps) * 1e-6
                except Exception as e:  # a config that does not fit: report and go on
                    print(f"{name:40s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    results["runs"].append({"name": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    continue
                extra = {}
                if args.check:
                    outs = fn(xs, weights)
                    errs = []
                    for w, y in zip(weights[:4], outs[:4]):
                        xf = jnp.tile(xs, (1, w.shape[1] // tile_k)).astype(jnp.float32)
                        ref = np.asarray(xf @ w.astype(jnp.float32).T)
                        got = np.asarray(y.sum(0)).T
                        errs.append(float(np.max(np.abs(got - ref)) / (np.max(np.abs(ref)) + 1e-9)))
                    extra["max_rel_err"] = max(errs)
                report(name, t, extra)
                if "max_rel_err" in extra:
                    print(f"{'':40s} max relative error {extra['max_rel_err']:.2e}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
