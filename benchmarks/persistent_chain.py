"""Can a persistent kernel run a decoder layer's chain of batch-1 products, each reading the one
before's output, as fast as it streams their weights? (`persistent_gemv.py` streams them with no data
flow between them.)

`persistent_chain` runs 8 sequences through QKV, O (over QKV's first 4096 rows, in place of
attention), gate/up, down (over silu(gate) * up) and the next layer's QKV, for `layers` layers: one
program per SM owns a rectangle of each product's tiles, a copier warpgroup streams their weights
through a shared-memory ring, and a compute warpgroup multiplies. The programs add their partial sums
into f32 outputs in L2 (TMA reduce-add) and count each finished block on a semaphore; a consumer waits
only for the blocks it reads. Every output of a dense product needs every input, so only boundaries
where the producer completes its output blocks in turn and the consumer reads them in that order can
overlap (CHAIN_SCHEDULES "alt"). `--skip` prices the kernel's parts (timing only: wrong results), and
`--profile` times its named regions inside the kernel (Mosaic GPU's on-device profiler).

Against it, in the same run: XLA's chain of the same products at batch 1 and at 8 sequences
(`chain_reference`, which also checks every product), and `persistent_gemv`'s stream with no waits.

  python benchmarks/persistent_chain.py --layers 4 --schedules k alt --store-rows 64 256 --skip waits inputs
  python benchmarks/persistent_chain.py --layers 1 --profile /tmp/chain-profile
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
from common import positive_int
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from kernels import cupti_us, print_regions, trace_regions
from persistent_gemv import COLS, LAYER, ROWS, persistent_gemv, setup, tiled_smem, xla_chain

from jengine.kernels_pallas.ragged_paged_attention import gpu_mosaic

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
PROFILED_RANGES = 250  # regions per warpgroup the profiler has room for in shared memory (one layer's)


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
                    with jax.named_scope("ring_full"):  # all `stages` tiles landed or in flight
                        pl.when(gl >= stages)(functools.partial(plgpu.barrier_wait, consumed.at[slot]))
                    plgpu.copy_gmem_to_smem(weight_tile(p, a * inner + b), w_smem.at[slot], produced.at[slot])

    @pl.when(wg == 0)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        with jax.named_scope("prologue"):  # zero the outputs the products add into, then one grid barrier
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
                    with jax.named_scope("producers"):
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
                with jax.named_scope("input"):
                    plgpu.barrier_wait(in_bars.at[2 * buf])
                    if kind == 3:
                        plgpu.barrier_wait(in_bars.at[2 * buf + 1])
                if "convert" in skip:
                    return
                with jax.named_scope("convert"):
                    v = plgpu.load(stage.at[buf, 0], layout=plgpu.Layout.WGMMA)
                    if kind == 3:
                        u = plgpu.load(stage.at[buf, 1], layout=plgpu.Layout.WGMMA)
                        v = v / (1.0 + jnp.exp(-v)) * u
                    x_smem.at[buf].transpose((1, 0))[...] = v.astype(x_smem.dtype)

            def tile(gl, buf, acc):
                slot = lax.rem(gl, stages)
                with jax.named_scope("weights"):  # the tile not landed yet: the memory is behind
                    plgpu.barrier_wait(produced.at[slot])

                def mm(acc_ref):
                    plgpu.wgmma(acc_ref, w_smem.at[slot], x_smem.at[buf].transpose((1, 0)))
                out = pl.run_state(mm)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(consumed.at[slot])
                return out

            group = store_rows // ROWS if nbr % (store_rows // ROWS) == 0 else 1  # n-blocks per store

            def store(accs, s, nb, p=p, group=group):
                """Add the sums of n-blocks nb .. nb + len(accs) into the output, through slot s."""
                with jax.named_scope("store"):
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
                with jax.named_scope("landed"):
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
                        with jax.named_scope("landed"):
                            plgpu.wait_smem_to_gmem(lag)
                            _fence_async_global()
                        signal(nb - lag * group)

                with jax.named_scope("landed"):
                    plgpu.wait_smem_to_gmem(0)
                    _fence_async_global()
                for s in range(max(0, nbr // group - lag), nbr // group):
                    signal(ri * nbr + s * group)


def persistent_chain(x0, weights, *, tile_k=256, stages=5, num_sms=128, schedule="alt", skip=(), store_rows=None,
                     profile_dir=None):
    """x0: [4096, 8] f32 (the first QKV's input, one column per sequence); weights: 4 x layers [N, K] bf16
    in LAYER's order. Returns every product's output [N, 8] f32. `store_rows` None: tile_k.
    `profile_dir`: also time the kernel's named regions with Mosaic GPU's on-device profiler, whose trace
    (`kernels.region_summary` reads it) goes there; room for PROFILED_RANGES regions per warpgroup."""
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
    scratch = [tiled_smem((stages, ROWS, tile_k), jnp.bfloat16), tiled_smem((2, COLS, tile_k), jnp.bfloat16),
               plgpu.SMEM((2, 2, tile_k, COLS), jnp.float32), plgpu.SMEM((OUT_ROWS, COLS), jnp.float32),
               plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
               plgpu.Barrier(num_barriers=4)]
    params = None if profile_dir is None else plgpu.CompilerParams(
        profile_space=PROFILED_RANGES, profile_dir=profile_dir, profile_bounds_check=True)
    return plgpu.kernel(
        functools.partial(_chain_kernel, layers=layers, tile_k=tile_k, stages=stages, num_sms=num_sms, plan=plan,
                          skip=skip, store_rows=store_rows),
        out_type=out_type, scratch_types=scratch, grid=(num_sms,), grid_names=("sm",), num_threads=2,
        thread_name="wg", compiler_params=params)(x0, *weights)


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


def _skip_parts(text):
    parts = text.split("+")
    if not set(parts) <= set(SKIPPABLE) or ("stores" in parts and "waits" not in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: '+'-joined parts of {SKIPPABLE} ('stores' only with 'waits')")
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--stages", type=positive_int, nargs="+", default=[5], help="weight tiles in each ring")
    ap.add_argument("--schedules", nargs="+", default=["alt"], choices=sorted(CHAIN_SCHEDULES),
                    help="k: every product k-block by k-block; alt: QKV and gate/up n-block by n-block, so that "
                         "O and down start on their first complete input blocks (CHAIN_SCHEDULES)")
    ap.add_argument("--store-rows", type=positive_int, nargs="+", default=[256], choices=[ROWS, 256],
                    help="rows per store of the sums: each n-block, or each row block of a consumer's k-block")
    ap.add_argument("--skip", nargs="*", default=[], type=_skip_parts,
                    help=f"also time each config without these parts, each a '+'-joined set of {SKIPPABLE} "
                         "(diagnostics: wrong results)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also run each config once under Mosaic GPU's on-device profiler (traces to DIR) and "
                         "print cycles per named region; it has room for one layer's regions (use --layers 1)")
    ap.add_argument("--reps", type=positive_int, default=20)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    if not gpu_mosaic.on_hopper():
        raise SystemExit(f"persistent_chain.py needs a Hopper GPU (Pallas Mosaic GPU); this is "
                         f"{jax.devices()[0].device_kind}")

    weights, x1, results, report = setup(args.layers)
    report("xla chain (batch 1)", cupti_us(jax.jit(xla_chain), (x1, weights), args.reps) * 1e-6)
    stream = jax.jit(functools.partial(persistent_gemv, tile_k=256, stages=6, barrier="none", num_sms=128))
    xs = jax.random.normal(jax.random.key(1), (COLS, 256), jnp.bfloat16)
    report("stream, no waits (persistent_gemv)", cupti_us(stream, (xs, weights), args.reps) * 1e-6)

    scale = [jnp.asarray(1.0 / np.sqrt(w.shape[1]) / 0.02, jnp.bfloat16) for w in weights]  # keep values O(1)
    ws = [w * s for w, s in zip(weights, scale)]
    x0 = jax.random.normal(jax.random.key(2), (LAYER[0][1], COLS), jnp.float32)
    ref_fn = jax.jit(chain_reference)
    ref = ref_fn(x0, ws)
    report("xla chain (8 sequences)", cupti_us(ref_fn, (x0, ws), args.reps) * 1e-6)
    for schedule, stages, rows, skip in itertools.product(args.schedules, args.stages, args.store_rows,
                                                               [""] + args.skip):
        name = (f"chain {schedule} stages={stages} store_rows={rows}"
                + (f" skip {skip} (wrong results)" if skip else ""))
        chain = functools.partial(persistent_chain, stages=stages, schedule=schedule, store_rows=rows,
                                  skip=tuple(skip.split("+")) if skip else ())
        fn = jax.jit(chain)
        try:
            outs = fn(x0, ws)
            errs = [float(jnp.max(jnp.abs(o - r)) / (jnp.max(jnp.abs(r)) + 1e-9)) for o, r in zip(outs, ref)]
            t = cupti_us(fn, (x0, ws), args.reps) * 1e-6
        except Exception as e:  # a config that does not fit: report and go on
            print(f"{name:40s} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
            results["runs"].append({"name": name, "error": f"{type(e).__name__}: {str(e)[:400]}"})
            continue
        extra = {"max_rel_err_per_product": errs}
        if args.profile:
            extra["regions"] = trace_regions(lambda d, c=chain: jax.jit(functools.partial(c, profile_dir=d))(x0, ws),
                                             args.profile)
        report(name, t, extra)
        print(f"{'':40s} relative error per product: max {max(errs):.2e}, last {errs[-1]:.2e}", flush=True)
        if args.profile:
            print_regions(extra["regions"])
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
