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

`--chain` times the real data flow (`persistent_chain`): each product reads the previous one's
output, summed across programs in L2, and waits only for the programs that produce the blocks it
reads. A dense chain can overlap only boundaries where the producer emits its output blocks in turn
and the consumer reads them in that order (CHAIN_SCHEDULES "alt"); `--chain-skip` prices its parts.

  python benchmarks/persistent_gemv.py --layers 4 --tile-k 512 --stages 3 --barriers grid self none
  python benchmarks/persistent_gemv.py --layers 4 --tile-k 256 --stages 6 --barriers none --num-sms 128 \
      --chain --chain-schedules k alt --chain-store-rows 64 256 --chain-skip waits inputs waits+stores
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import re
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from common import non_negative_int, positive_int
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jengine.kernels_pallas.ragged_paged_attention import gpu_mosaic

ROWS = 64  # weight rows per tile: the wgmma's M
COLS = 8  # sequences: the wgmma's N
LAYER = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # [N, K] of QKV, O, gate/up, down (8B)


def _tiled(shape, dtype):
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
    scratch = [_tiled((stages, ROWS, tile_k), jnp.bfloat16), _tiled((COLS, tile_k), jnp.bfloat16),
               plgpu.SMEM((2, ROWS, COLS), jnp.float32), plgpu.Barrier(num_barriers=stages),
               plgpu.Barrier(num_barriers=stages), plgpu.Barrier()]
    return plgpu.kernel(
        functools.partial(_kernel, shapes=shapes, tile_k=tile_k, stages=stages, num_sms=num_sms, barrier=barrier),
        out_type=out_type, scratch_types=scratch, grid=(num_sms,), grid_names=("sm",), num_threads=2,
        thread_name="wg")(x, *weights)


# How each product of a layer (QKV, O, gate/up, down) is split and ordered: (k-groups, order). Every
# program owns a rectangle of n-blocks x k-blocks, so each output block has `groups` producers and each
# program needs its k-group of the input only. Order "k": k-block by k-block, an accumulator per n-block
# (it can start on its first input block, but its outputs complete only when its whole share does).
# Order "n": its whole k-group of input first, then n-block by n-block (each output block complete in
# turn, so a "k" consumer can start before the product ends). A dense matrix-vector chain can overlap
# only such "n" -> "k" boundaries: every output of a product needs every input.
CHAIN_SCHEDULES = {
    "k": ((4, "k"), (4, "k"), (4, "k"), (8, "k")),
    "alt": ((16, "n"), (8, "k"), (8, "n"), (8, "k")),
}
HALF = LAYER[3][1]  # gate rows, then up rows, in the gate/up product's output
OUT_ROWS = 512  # shared-memory rows the sums leave through
SKIPPABLE = ("waits", "inputs", "convert", "stores", "reduce")  # persistent_chain's timing diagnostics


def _fence_async_global():
    from jax._src.pallas.mosaic_gpu.helpers import inline_ptx  # not exported by jax 0.11

    inline_ptx("fence.proxy.async.global;")


def chain_plan(layers, tile_k, num_sms, schedule="alt"):
    """Per product: (groups, n-blocks per program, k-blocks per program, the program's first ring slot,
    order)."""
    if schedule not in CHAIN_SCHEDULES:
        raise ValueError(f"persistent_chain: schedule must be one of {sorted(CHAIN_SCHEDULES)}, got {schedule!r}")
    plan, offset = [], 0
    for p, (n, k) in enumerate(LAYER * layers):
        g, order = CHAIN_SCHEDULES[schedule][p % 4]
        if num_sms % g or (n // ROWS) % (num_sms // g) or k % tile_k or (k // tile_k) % g:
            raise ValueError(f"persistent_chain: product {p} [N, K] = {(n, k)} does not split into {num_sms} "
                             f"programs of {g} k-groups with tile_k {tile_k}")
        nbr, kbr = (n // ROWS) // (num_sms // g), (k // tile_k) // g
        if order == "n" and (kbr > 2 or p % 4 == 3):
            raise ValueError(f"persistent_chain: product {p} in order 'n' needs at most 2 k-blocks per program "
                             f"and cannot be down (got {kbr})")
        plan.append((g, nbr, kbr, offset, order))
        offset += nbr * kbr
    return plan


def _k_block(plan, p, j, gi, tile_k):
    """The j-th k-block program group `gi` of product p reads. After an "n" product, a program of two
    k-blocks reads first the one whose producers complete it first (its level in their shares)."""
    _, _, kbr, _, _ = plan[p]
    first = gi * kbr
    if p == 0 or kbr != 2 or plan[p - 1][4] != "n" or plan[p - 1][1] % (tile_k // ROWS):
        return first + j
    per = tile_k // ROWS
    level = lambda r: lax.rem(r * per, plan[p - 1][1]) // per  # noqa: E731
    swap = (level(first) > level(first + 1)).astype(jnp.int32)
    return first + swap + j * (1 - 2 * swap)


def _tile_at(plan, p, q, gi, ri, tile_k):
    """Product p's q-th tile in a program's order: (n-block, k-block)."""
    _, nbr, kbr, _, order = plan[p]
    j, i = (q // nbr, q % nbr) if order == "k" else (q % kbr, q // kbr)
    return ri * nbr + i, _k_block(plan, p, j, gi, tile_k)


def _chain_kernel(x0_ref, *refs, layers, tile_k, stages, num_sms, plan, skip, store_rows):
    """A chain of dependent products: QKV; O over QKV's first 4096 rows (in place of attention); gate/up;
    down over silu(gate) * up; the next layer's QKV over down's output. Each program adds its partial
    products into f32 outputs (TMA reduce-add) and counts each finished n-block on its row block's
    semaphore; a consumer waits for the row blocks its k-group reads, and nothing else.
    `store_rows`: rows per store, ROWS (each n-block) or tile_k (each row block of n-blocks, where a
    program's share holds whole row blocks). The sums leave through OUT_ROWS rows of shared memory, in
    slots of `store_rows`; an "n" product counts a store once the stores of half the slots after it are
    issued (waiting for one to land stalls the compute warpgroup).
    `skip` (timing diagnostics, whose results are wrong): "waits" for producers; "inputs", each k-block's
    load and conversion; "convert", only the conversion (the load still lands); "stores", the sums'
    stores and counts (with "waits" only); "reduce", the reduction of the stores (they overwrite)."""
    phases = 4 * layers
    shapes = LAYER * layers
    w_refs, y_refs = refs[:phases], refs[phases:2 * phases]
    w_smem, x_smem, stage, o_smem, produced, consumed, in_bars = refs[2 * phases:]
    sm, wg = lax.axis_index("sm"), lax.axis_index("wg")
    per = tile_k // ROWS  # n-blocks per row block of a consumer's k-block
    slots = OUT_ROWS // store_rows
    lag = slots // 2
    base = [0]
    for n, _ in shapes:
        base.append(base[-1] + n // tile_k)
    sems = pl.get_global(plgpu.SemaphoreType.REGULAR((base[-1] + 1,)))
    start = base[-1]
    def weight_tile(p, q):
        g = plan[p][0]
        nb, kb = _tile_at(plan, p, q, lax.rem(sm, g), sm // g, tile_k)
        return w_refs[p].at[pl.ds(nb * ROWS, ROWS), pl.ds(kb * tile_k, tile_k)]

    @pl.when(wg == 1)
    def _copier():
        plgpu.set_max_registers(40, action="decrease")
        for p, (_, nbr, kbr, off, order) in enumerate(plan):
            outer, inner = (kbr, nbr) if order == "k" else (nbr, kbr)

            @pl.loop(0, outer)
            def _(a, p=p, off=off, inner=inner):
                for b in range(inner):
                    gl = off + a * inner + b
                    slot = lax.rem(gl, stages)
                    pl.when(gl >= stages)(functools.partial(plgpu.barrier_wait, consumed.at[slot]))
                    plgpu.copy_gmem_to_smem(weight_tile(p, a * inner + b), w_smem.at[slot], produced.at[slot])

    @pl.when(wg == 0)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        # Zero the outputs the products add into, then one grid barrier.
        o_smem[...] = jnp.zeros(o_smem.shape, jnp.float32)
        plgpu.commit_smem()
        for p, (n, _) in enumerate(shapes):
            @pl.loop(sm, n // ROWS, step=num_sms)
            def _(nb, p=p):
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, ROWS)], y_refs[p].at[pl.ds(nb * ROWS, ROWS)])
        plgpu.wait_smem_to_gmem(0)
        _fence_async_global()
        plgpu.semaphore_signal(sems.at[start], 1, memory_scope="gpu")
        plgpu.semaphore_wait(sems.at[start], num_sms, decrement=False, memory_scope="gpu")
        zero = functools.partial(plgpu.layout_cast, jnp.zeros((ROWS, COLS), jnp.float32), plgpu.Layout.WGMMA)

        for p, (g, nbr, kbr, off, order) in enumerate(plan):
            gi, ri = lax.rem(sm, g), sm // g
            kind = p % 4
            src = x0_ref if p == 0 else y_refs[p - 1]
            # Signals a row block of input gets: its producers x n-blocks.
            need = plan[p - 1][0] * per if p and "waits" not in skip else None

            def issue(j, buf, kind=kind, src=src, need=need, gi=gi, p=p):
                """Wait for the producers of the j-th k-block, then start loading it into stage[buf]."""
                if "inputs" in skip:
                    return
                kb = _k_block(plan, p, j, gi, tile_k)
                if need is not None:
                    plgpu.semaphore_wait(sems.at[base[p - 1] + kb], need, decrement=False, memory_scope="gpu")
                    if kind == 3:
                        plgpu.semaphore_wait(sems.at[base[p - 1] + HALF // tile_k + kb], need, decrement=False,
                                             memory_scope="gpu")
                    _fence_async_global()
                plgpu.copy_gmem_to_smem(src.at[pl.ds(kb * tile_k, tile_k)], stage.at[buf, 0], in_bars.at[2 * buf])
                if kind == 3:
                    plgpu.copy_gmem_to_smem(src.at[pl.ds(HALF + kb * tile_k, tile_k)], stage.at[buf, 1],
                                            in_bars.at[2 * buf + 1])

            def operand(buf, kind=kind):
                """The loaded k-block (silu(gate) * up for down) as the wgmma's bf16 operand, x_smem[buf]."""
                if "inputs" in skip:
                    return
                plgpu.barrier_wait(in_bars.at[2 * buf])
                if kind == 3:
                    plgpu.barrier_wait(in_bars.at[2 * buf + 1])
                if "convert" in skip:
                    return
                v = plgpu.load(stage.at[buf, 0], layout=plgpu.Layout.WGMMA)
                if kind == 3:
                    u = plgpu.load(stage.at[buf, 1], layout=plgpu.Layout.WGMMA)
                    v = v / (1.0 + jnp.exp(-v)) * u
                x_smem.at[buf].transpose((1, 0))[...] = v.astype(x_smem.dtype)

            def tile(gl, buf, acc):
                slot = lax.rem(gl, stages)
                plgpu.barrier_wait(produced.at[slot])

                def mm(acc_ref):
                    plgpu.wgmma(acc_ref, w_smem.at[slot], x_smem.at[buf].transpose((1, 0)))
                out = pl.run_state(mm)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(consumed.at[slot])
                return out

            group = store_rows // ROWS if nbr % (store_rows // ROWS) == 0 else 1  # n-blocks per store

            def store(accs, s, nb, p=p, group=group):
                """Add the sums of n-blocks nb .. nb + len(accs) into the output, through slot s."""
                row = lax.rem(s, OUT_ROWS // (group * ROWS)) * group * ROWS
                plgpu.wait_smem_to_gmem(OUT_ROWS // (group * ROWS) - 1, wait_read_only=True)
                for u, acc in enumerate(accs):
                    o_smem.at[pl.ds(row + u * ROWS, ROWS)][...] = acc
                if "stores" in skip:
                    return
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(row, group * ROWS)],
                                        y_refs[p].at[pl.ds(nb * ROWS, group * ROWS)],
                                        reduction_op=None if "reduce" in skip else "add")

            def signal(nb, p=p, group=group):
                """Count the group of n-blocks from nb on their row block's semaphore."""
                if "stores" in skip:
                    return
                plgpu.semaphore_signal(sems.at[base[p] + nb // per], group, memory_scope="gpu")

            if order == "k":
                issue(0, 0)

                def k_step(j, accs, kbr=kbr, nbr=nbr, off=off, issue=issue, operand=operand, tile=tile):
                    buf = lax.rem(j, 2)
                    pl.when(j + 1 < kbr)(lambda: issue(j + 1, 1 - buf))
                    operand(buf)
                    plgpu.commit_smem()
                    return tuple(tile(off + j * nbr + i, buf, accs[i]) for i in range(nbr))

                accs = lax.fori_loop(0, kbr, k_step, tuple(zero() for _ in range(nbr)))
                for s in range(nbr // group):
                    store(accs[s * group:(s + 1) * group], s, ri * nbr + s * group)
                plgpu.wait_smem_to_gmem(0)
                _fence_async_global()
                for s in range(nbr // group):
                    signal(ri * nbr + s * group)
            else:
                for j in range(kbr):
                    issue(j, j)
                for j in range(kbr):
                    operand(j)
                plgpu.commit_smem()

                @pl.loop(0, nbr // group)
                def _(s, kbr=kbr, nbr=nbr, off=off, ri=ri, tile=tile, store=store, signal=signal, group=group):
                    accs = []
                    for u in range(group):
                        acc = zero()
                        for j in range(kbr):
                            acc = tile(off + (s * group + u) * kbr + j, j, acc)
                        accs.append(acc)
                    nb = ri * nbr + s * group
                    store(accs, s, nb)

                    @pl.when(s >= lag)
                    def _():  # the sums of the store `lag` before have landed: count them
                        plgpu.wait_smem_to_gmem(lag)
                        _fence_async_global()
                        signal(nb - lag * group)

                plgpu.wait_smem_to_gmem(0)
                _fence_async_global()
                for s in range(max(0, nbr // group - lag), nbr // group):
                    signal(ri * nbr + s * group)


def persistent_chain(x0, weights, *, tile_k=256, stages=5, num_sms=128, schedule="alt", skip=(), store_rows=None):
    """x0: [4096, 8] f32 (the first QKV's input, one column per sequence); weights: 4 x layers [N, K] bf16
    in LAYER's order. Returns every product's output [N, 8] f32. `store_rows` None: tile_k."""
    store_rows = store_rows or tile_k
    layers = len(weights) // 4
    if len(weights) != 4 * layers or tuple(w.shape for w in weights) != LAYER * layers:
        raise ValueError(f"persistent_chain: weights must be {layers} layers of {LAYER}")
    if any(w.dtype != jnp.bfloat16 for w in weights) or x0.shape != (LAYER[0][1], COLS) or x0.dtype != jnp.float32:
        raise ValueError(f"persistent_chain: weights must be bf16 and x0 [{LAYER[0][1]}, {COLS}] f32, got "
                         f"{sorted({str(w.dtype) for w in weights})} and {x0.dtype}{list(x0.shape)}")
    plan = chain_plan(layers, tile_k, num_sms, schedule)
    skip = frozenset(skip)
    if store_rows not in (ROWS, tile_k) or OUT_ROWS % store_rows or OUT_ROWS // store_rows < 2:
        raise ValueError(f"persistent_chain: store_rows must be {ROWS} or tile_k ({tile_k}, at most "
                         f"{OUT_ROWS // 2}), got {store_rows}")
    if not skip <= set(SKIPPABLE) or ("stores" in skip and "waits" not in skip):
        raise ValueError(f"persistent_chain: skip must hold some of {SKIPPABLE} ('stores' only with 'waits'), "
                         f"got {sorted(skip)}")
    out_type = [jax.ShapeDtypeStruct((n, COLS), jnp.float32) for n, _ in LAYER * layers]
    scratch = [_tiled((stages, ROWS, tile_k), jnp.bfloat16), _tiled((2, COLS, tile_k), jnp.bfloat16),
               plgpu.SMEM((2, 2, tile_k, COLS), jnp.float32), plgpu.SMEM((OUT_ROWS, COLS), jnp.float32),
               plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
               plgpu.Barrier(num_barriers=4)]
    return plgpu.kernel(
        functools.partial(_chain_kernel, layers=layers, tile_k=tile_k, stages=stages, num_sms=num_sms, plan=plan,
                          skip=skip, store_rows=store_rows),
        out_type=out_type, scratch_types=scratch, grid=(num_sms,), grid_names=("sm",), num_threads=2,
        thread_name="wg")(x0, *weights)


def chain_reference(x0, weights):
    """persistent_chain's products in jnp: bf16 inputs, f32 sums."""
    outs, x = [], x0
    for p, w in enumerate(weights):
        if p % 4 == 1:
            x = outs[-1][:w.shape[1]]
        elif p % 4 == 2 or (p % 4 == 0 and p):
            x = outs[-1]
        elif p % 4 == 3:
            gate, up = outs[-1][:HALF], outs[-1][HALF:]
            x = gate / (1.0 + jnp.exp(-gate)) * up
        outs.append(jnp.dot(w, x.astype(jnp.bfloat16), preferred_element_type=jnp.float32))
    return outs


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


def _time(fn, *args, reps):
    """Median seconds of one call's GPU kernels, summed by CUPTI (no host time, no launch gaps)."""
    from jax.experimental.mosaic.gpu import profiler

    jax.block_until_ready(fn(*args))
    timed = profiler.measure(fn)
    times = [timed(*args)[1] for _ in range(reps)]
    return statistics.median(t for t in times if t is not None) / 1e3


def _time_chain(args, weights, key, report, results):
    """persistent_chain against chain_reference (XLA, 8 sequences), each checked against the other."""
    scale = [jnp.asarray(1.0 / np.sqrt(w.shape[1]) / 0.02, jnp.bfloat16) for w in weights]  # keep values O(1)
    ws = [w * s for w, s in zip(weights, scale)]
    x0 = jax.random.normal(key, (4096, COLS), jnp.float32)
    ref_fn = jax.jit(chain_reference)
    ref = ref_fn(x0, ws)
    report("xla chain (8 sequences)", _time(ref_fn, x0, ws, reps=args.reps))
    variants = itertools.product(args.chain_schedules, args.chain_stages, args.chain_store_rows,
                                 [""] + args.chain_skip)
    for schedule, stages, rows, skip in variants:
        name = (f"persistent chain {schedule} stages={stages} store_rows={rows}"
                + (f" skip {skip} (wrong results)" if skip else ""))
        fn = jax.jit(functools.partial(persistent_chain, stages=stages, schedule=schedule, store_rows=rows,
                                       skip=tuple(skip.split("+")) if skip else ()))
        try:
            outs = fn(x0, ws)
            errs = [float(jnp.max(jnp.abs(o - r)) / (jnp.max(jnp.abs(r)) + 1e-9)) for o, r in zip(outs, ref)]
            t = _time(fn, x0, ws, reps=args.reps)
        except Exception as e:  # a config that does not fit: report and go on
            print(f"{name:40s} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
            results["runs"].append({"name": name, "error": f"{type(e).__name__}: {str(e)[:400]}"})
            continue
        report(name, t, {"max_rel_err_per_product": errs})
        print(f"{'':40s} relative error per product: max {max(errs):.2e}, last {errs[-1]:.2e}", flush=True)


def _skip_parts(text):
    parts = text.split("+")
    if not set(parts) <= set(SKIPPABLE) or ("stores" in parts and "waits" not in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: '+'-joined parts of {SKIPPABLE} ('stores' only with 'waits')")
    return text


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
    ap.add_argument("--chain", action="store_true",
                    help="also time persistent_chain (each product's input read from the previous one's output, "
                         "waits only for its producers; 128 programs, tile_k 256) against the same chain in XLA")
    ap.add_argument("--chain-stages", type=positive_int, nargs="+", default=[5])
    ap.add_argument("--chain-schedules", nargs="+", default=["alt"], choices=sorted(CHAIN_SCHEDULES),
                    help="k: every product k-block by k-block; alt: QKV and gate/up n-block by n-block, so that "
                         "O and down start on their first complete input blocks (CHAIN_SCHEDULES)")
    ap.add_argument("--chain-store-rows", type=positive_int, nargs="+", default=[256], choices=[ROWS, 256],
                    help="rows per store of the sums: each n-block, or each row block of a consumer's k-block")
    ap.add_argument("--chain-skip", nargs="*", default=[], type=_skip_parts,
                    help=f"also time each schedule without these parts, each a '+'-joined set of {SKIPPABLE} "
                         "(diagnostics: wrong results)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    bad = [b for b in args.barriers if b not in ("grid", "self", "none") and not re.fullmatch(r"near[1-9][0-9]*", b)]
    if bad:
        ap.error(f"--barriers: {bad[0]!r} is not grid, near<k>, self or none")
    if not gpu_mosaic.on_hopper():
        raise SystemExit(f"persistent_gemv.py needs a Hopper GPU (Pallas Mosaic GPU); this is "
                         f"{jax.devices()[0].device_kind}")

    key = jax.random.key(0)
    shapes = [s for _ in range(args.layers) for s in LAYER]
    keys = jax.random.split(key, len(shapes) + 1)
    weights = [jax.random.normal(k, s, jnp.bfloat16) * 0.02 for k, s in zip(keys[1:], shapes)]
    nbytes = sum(w.size * 2 for w in weights)
    results = {"layers": args.layers, "weight_bytes": nbytes, "device": str(jax.devices()[0]), "runs": []}

    def report(name, seconds, extra=None):
        row = {"name": name, "us": seconds * 1e6, "us_per_layer": seconds * 1e6 / args.layers,
               "weight_TBps": nbytes / seconds / 1e12, **(extra or {})}
        results["runs"].append(row)
        print(f"{name:40s} {row['us']:9.1f} us  {row['us_per_layer']:7.1f} us/layer  {row['weight_TBps']:.2f} TB/s",
              flush=True)

    flat = jnp.concatenate([w.reshape(-1) for w in weights])
    copy = jax.jit(lambda a: a + jnp.bfloat16(1))
    t = _time(copy, flat, reps=args.reps)
    results["runs"].append({"name": "copy (read + write)", "us": t * 1e6, "TBps": 2 * nbytes / t / 1e12})
    print(f"{'copy (read + write)':40s} {t * 1e6:9.1f} us  {2 * nbytes / t / 1e12:.2f} TB/s of traffic", flush=True)
    del flat

    x1 = jax.random.normal(keys[0], (1, 4096), jnp.bfloat16)
    report("xla chain (batch 1)", _time(jax.jit(xla_chain), x1, weights, reps=args.reps))

    for tile_k in args.tile_k:
        xs = jax.random.normal(keys[0], (COLS, tile_k), jnp.bfloat16)
        for stages in args.stages:
            for barrier, sms in itertools.product(args.barriers, args.num_sms):
                name = f"persistent tile_k={tile_k} stages={stages} barrier={barrier} sms={sms or 'all'}"
                fn = jax.jit(functools.partial(persistent_gemv, tile_k=tile_k, stages=stages, barrier=barrier,
                                               num_sms=sms or None))
                try:
                    t = _time(fn, xs, weights, reps=args.reps)
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
    if args.chain:
        _time_chain(args, weights, keys[0], report, results)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
