"""benchmarks/persistent_gemv.py: the shares it splits products into, its input checks, and (on Hopper)
its products against jnp under every kind of wait."""

from __future__ import annotations

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
                                          (["--barriers", "near0"], "--barriers")])
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
