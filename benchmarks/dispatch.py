"""Host cost of launching a jitted step while the previous one still runs (does dispatch block?).

    python benchmarks/dispatch.py

A chain of ~10 ms matmul steps carrying a large buffer, launched back to back; prints the median
launch time per variant: donated vs not, numpy vs device arguments, few vs many arguments, and a
`lax.cond` on a device-computed predicate.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def _work(cache, x, w, idx, extra):
    y = x
    for _ in range(24):
        y = jnp.tanh(y @ w)
    cache = cache.at[idx].set(y[0, 0].astype(cache.dtype) + sum(e.sum() for e in extra).astype(cache.dtype))
    return cache, y[0, :4]


def _work_cond(cache, x, w, idx, extra):
    cache, y = _work(cache, x, w, idx, extra)
    z = jax.lax.cond(jnp.any(y > 0.5), lambda: y * 2, lambda: y)  # predicate computed on the device
    return cache, z


def main() -> None:
    w = jax.random.normal(jax.random.PRNGKey(0), (4096, 4096), jnp.bfloat16) * 0.01
    x = jnp.ones((8192, 4096), jnp.bfloat16)
    donated = jax.jit(_work, donate_argnums=(0,))
    kept = jax.jit(_work)
    with_cond = jax.jit(_work_cond, donate_argnums=(0,))
    for name, fn, numpy_args, n_extra in [
        ("donate, device args", donated, False, 2), ("donate, numpy args", donated, True, 2),
        ("donate, 30 numpy args", donated, True, 30), ("no donation, numpy args", kept, True, 2),
        ("donate, device args, lax.cond", with_cond, False, 2),
    ]:
        cache = jnp.zeros((1 << 28,), jnp.bfloat16)
        extra = [np.arange(64, dtype=np.int32) for _ in range(n_extra)]
        if not numpy_args:
            extra = [jnp.asarray(e) for e in extra]
        launches = []
        cache, out = fn(cache, x, w, np.int32(0), extra)
        jax.block_until_ready(out)
        start = time.perf_counter()
        for i in range(20):
            t = time.perf_counter()
            cache, out = fn(cache, x, w, np.int32(i) if numpy_args else jnp.int32(i), extra)
            launches.append(time.perf_counter() - t)
        jax.block_until_ready(out)
        total = time.perf_counter() - start
        print(f"{name:28s} launch median {1e3 * statistics.median(launches):7.3f} ms, "
              f"step {1e3 * total / 20:7.2f} ms")


if __name__ == "__main__":
    main()
