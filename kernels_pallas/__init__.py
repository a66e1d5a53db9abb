"""Pallas kernels for jengine, each with a pure-jnp reference beside it."""
