"""benchmarks/persistent_chain.py: how it splits and orders each product's tiles, its input checks, and
(on Hopper) the chain against jnp under each schedule and store size."""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import persistent_chain as pc  # noqa: E402

from jengine.kernels_pallas.ragged_paged_attention import gpu_mosaic  # noqa: E402


def test_chain_plan_gives_every_program_an_equal_rectangle():
    for schedule, rects in (("k", [(4, 3, 4), (4, 2, 4), (4, 14, 4), (8, 4, 7)]),
                            ("alt", [(16, 12, 1), (8, 4, 2), (8, 28, 2), (8, 4, 7)])):
        plan = pc.chain_plan(2, 256, 128, schedule)
        assert [(g, nbr, kbr) for g, nbr, kbr, *_ in plan[:4]] == rects
        offsets = [off for *_, off, _ in plan]
        assert offsets == [sum(n * k for _, n, k, *_ in plan[:i]) for i in range(len(plan))]
        for p, (g, nbr, kbr, *_), (n, k) in zip(range(8), plan, pc.LAYER * 2):  # every tile once per product
            tiles = {tuple(int(v) for v in pc._tile_at(plan, p, q, sm % g, sm // g, 256))
                     for sm in range(128) for q in range(nbr * kbr)}
            assert tiles == {(nb, kb) for nb in range(n // 64) for kb in range(k // 256)}


def test_chain_alt_schedule_reads_first_the_block_its_producers_complete_first():
    plan = pc.chain_plan(1, 256, 128, "alt")
    for gi in range(8):  # O after QKV: QKV's row block r completes at level r % 3 of its producers' shares
        order = [int(pc._k_block(plan, 1, j, gi, 256)) for j in range(2)]
        assert sorted(order) == [2 * gi, 2 * gi + 1] and order[0] % 3 <= order[1] % 3


def test_chain_refuses_other_dtypes():
    ws = [jax.ShapeDtypeStruct(s, jnp.float32) for s in pc.LAYER]
    x0 = jax.ShapeDtypeStruct((4096, 8), jnp.float32)
    with pytest.raises(ValueError, match="must be bf16"):
        jax.eval_shape(pc.persistent_chain, x0, ws)


def test_chain_refuses_other_store_rows_and_skips():
    ws = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in pc.LAYER]
    x0 = jax.ShapeDtypeStruct((4096, 8), jnp.float32)
    with pytest.raises(ValueError, match="store_rows must be"):
        jax.eval_shape(functools.partial(pc.persistent_chain, store_rows=128), x0, ws)
    with pytest.raises(ValueError, match="skip must hold"):
        jax.eval_shape(functools.partial(pc.persistent_chain, skip=("stores",)), x0, ws)


def test_chain_plan_refuses_shares_that_do_not_divide():
    with pytest.raises(ValueError, match="does not split"):
        pc.chain_plan(1, 256, 132)
    with pytest.raises(ValueError, match="schedule must be"):
        pc.chain_plan(1, 256, 128, "z")


@pytest.mark.skipif(not gpu_mosaic.on_hopper(), reason="Pallas Mosaic GPU kernel: Hopper only")
def test_chain_matches_jnp():
    ws = [(jax.random.normal(jax.random.key(i), s) / np.sqrt(s[1])).astype(jnp.bfloat16)
          for i, s in enumerate(pc.LAYER)]
    x0 = jax.random.normal(jax.random.key(9), (4096, 8), jnp.float32)
    ref = pc.chain_reference(x0, ws)
    for schedule, rows in [(s, 64) for s in pc.CHAIN_SCHEDULES] + [("alt", 256)]:
        for o, r in zip(pc.persistent_chain(x0, ws, schedule=schedule, store_rows=rows), ref):
            assert float(jnp.max(jnp.abs(o - r)) / jnp.max(jnp.abs(r))) < 1e-2


@pytest.mark.parametrize("argv,message", [(["--layers", "0"], "--layers"), (["--skip", "stores"], "--skip"),
                                          (["--skip", "waits+nothing"], "--skip"), (["--store-rows", "128"],
                                                                                      "--store-rows")])
def test_bad_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        pc.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(gpu_mosaic.on_hopper(), reason="the refusal is for machines without a Hopper GPU")
def test_main_refuses_without_hopper():
    with pytest.raises(SystemExit, match="needs a Hopper GPU"):
        pc.main(["--layers", "1"])
