"""benchmarks/persistent_gemv.py: the shares it splits products into, its input checks, and (on Hopper)
its products against jnp under every kind of wait, and the dependent chain against jnp."""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import persistent_gemv as pg  # noqa: E402

from jengine.kernels_pallas.ragged_paged_attention import gpu_mosaic  # noqa: E402


@pytest.mark.parametrize("tiles,programs", [(768, 132), (512, 128), (7, 132), (3584, 132)])
def test_shares_cover_every_tile_once_and_differ_by_at_most_one(tiles, programs):
    shares = [pg._bounds(tiles, s, programs) for s in range(programs)]
    assert shares[0][0] == 0 and shares[-1][1] == tiles
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    sizes = [hi - lo for lo, hi in shares]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("kwargs,message", [
    (dict(barrier="all"), "barrier must be"),
    (dict(barrier="near0"), "barrier must be"),
    (dict(barrier="near200"), "barrier must be"),
    (dict(tile_k=96), "K % 96"),
])
def test_bad_arguments_are_value_errors(kwargs, message):
    w = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((8, kwargs.get("tile_k", 128)), jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(lambda x, w: pg.persistent_gemv(x, [w], num_sms=132, **{"tile_k": 128, **kwargs}), x, w)


@pytest.mark.parametrize("argv,message", [(["--layers", "0"], "--layers"), (["--stages", "-1"], "--stages"),
                                          (["--barriers", "near0"], "--barriers"),
                                          (["--chain-skip", "stores"], "--chain-skip"),
                                          (["--chain-skip", "waits+nothing"], "--chain-skip")])
def test_bad_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        pg.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(gpu_mosaic.on_hopper(), reason="the refusal is for machines without a Hopper GPU")
def test_main_refuses_without_hopper():
    with pytest.raises(SystemExit, match="needs a Hopper GPU"):
        pg.main(["--layers", "1"])


@pytest.mark.skipif(not gpu_mosaic.on_hopper(), reason="Pallas Mosaic GPU kernel: Hopper only")
@pytest.mark.parametrize("barrier", ["grid", "near2", "self", "none"])
def test_products_match_jnp(barrier):
    shapes = [(192, 512), (128, 256), (256, 768)]
    ws = [jax.random.normal(jax.random.key(i), s, jnp.bfloat16) for i, s in enumerate(shapes)]
    x = jax.random.normal(jax.random.key(9), (8, 256), jnp.bfloat16)
    outs = pg.persistent_gemv(x, ws, tile_k=256, stages=3, barrier=barrier)
    for w, y in zip(ws, outs):
        xf = jnp.tile(x, (1, w.shape[1] // 256)).astype(jnp.float32)
        ref = np.asarray(xf @ w.astype(jnp.float32).T)
        np.testing.assert_allclose(np.asarray(y.sum(0)).T, ref, rtol=1e-4, atol=1e-3)


def test_chain_plan_gives_every_program_an_equal_rectangle():
    for schedule, rects in (("k", [(4, 3, 4), (4, 2, 4), (4, 14, 4), (8, 4, 7)]),
                            ("alt", [(16, 12, 1), (8, 4, 2), (8, 28, 2), (8, 4, 7)])):
        plan = pg.chain_plan(2, 256, 128, schedule)
        assert [(g, nbr, kbr) for g, nbr, kbr, *_ in plan[:4]] == rects
        offsets = [off for *_, off, _ in plan]
        assert offsets == [sum(n * k for _, n, k, *_ in plan[:i]) for i in range(len(plan))]
        for p, (g, nbr, kbr, *_), (n, k) in zip(range(8), plan, pg.LAYER * 2):  # every tile once per product
            tiles = {tuple(int(v) for v in pg._tile_at(plan, p, q, sm % g, sm // g, 256))
                     for sm in range(128) for q in range(nbr * kbr)}
            assert tiles == {(nb, kb) for nb in range(n // 64) for kb in range(k // 256)}


def test_chain_alt_schedule_reads_first_the_block_its_producers_complete_first():
    plan = pg.chain_plan(1, 256, 128, "alt")
    for gi in range(8):  # O after QKV: QKV's row block r completes at level r % 3 of its producers' shares
        order = [int(pg._k_block(plan, 1, j, gi, 256)) for j in range(2)]
        assert sorted(order) == [2 * gi, 2 * gi + 1] and order[0] % 3 <= order[1] % 3


def test_chain_refuses_other_dtypes():
    ws = [jax.ShapeDtypeStruct(s, jnp.float32) for s in pg.LAYER]
    x0 = jax.ShapeDtypeStruct((4096, 8), jnp.float32)
    with pytest.raises(ValueError, match="must be bf16"):
        jax.eval_shape(pg.persistent_chain, x0, ws)


def test_chain_refuses_other_store_rows_and_skips():
    ws = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in pg.LAYER]
    x0 = jax.ShapeDtypeStruct((4096, 8), jnp.float32)
    with pytest.raises(ValueError, match="store_rows must be"):
        jax.eval_shape(functools.partial(pg.persistent_chain, store_rows=128), x0, ws)
    with pytest.raises(ValueError, match="skip must hold"):
        jax.eval_shape(functools.partial(pg.persistent_chain, skip=("stores",)), x0, ws)


def test_chain_plan_refuses_shares_that_do_not_divide():
    with pytest.raises(ValueError, match="does not split"):
        pg.chain_plan(1, 256, 132)
    with pytest.raises(ValueError, match="schedule must be"):
        pg.chain_plan(1, 256, 128, "z")


@pytest.mark.skipif(not gpu_mosaic.on_hopper(), reason="Pallas Mosaic GPU kernel: Hopper only")
def test_chain_matches_jnp():
    ws = [(jax.random.normal(jax.random.key(i), s) / np.sqrt(s[1])).astype(jnp.bfloat16)
          for i, s in enumerate(pg.LAYER)]
    x0 = jax.random.normal(jax.random.key(9), (4096, 8), jnp.float32)
    ref = pg.chain_reference(x0, ws)
    for schedule, rows in [(s, 64) for s in pg.CHAIN_SCHEDULES] + [("alt", 256)]:
        for o, r in zip(pg.persistent_chain(x0, ws, schedule=schedule, store_rows=rows), ref):
            assert float(jnp.max(jnp.abs(o - r)) / jnp.max(jnp.abs(r))) < 1e-2
