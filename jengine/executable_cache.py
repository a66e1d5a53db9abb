"""Compiled step programs on disk, keyed before lowering, so that a warm start skips lowering too.

JAX's persistent compilation cache (`engine._enable_compilation_cache`) keys on the lowered module,
so every start still lowers every program: on an H200 ~0.3-0.4 s of Python per bucket for the Pallas
Mosaic GPU kernel alone. This cache keys on the *traced* program (its jaxpr and everything else that
decides what XLA builds from it) and keeps the serialized executable: a hit costs a trace, a hash
and a load. A miss is lowered and compiled as before (through JAX's cache) and then stored.

Entries are pickles, as `jax.experimental.serialize_executable` makes them: loading one can run
code, so point the cache only at a directory you own. A read that fails in any way is a miss and a
write that fails is skipped; both are logged, neither stops the engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import tempfile
import threading

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable
from jax.extend.core import subjaxprs

logger = logging.getLogger(__name__)

FORMAT = 1  # of the entry files; part of the key, so a new layout never reads an old file
# JAX records both in the thread that asked to compile: a compile that went to its persistent cache
# (a request), and one that the cache served (a hit). A compile that records neither was served from
# JAX's in-memory caches: the same program, traced and compiled earlier in this process.
_JAX_CACHE_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"
_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_compiling = threading.local()  # .jax_cache_request / .jax_cache_hit: what this thread's last compile did

# Object reprs name their address (`<function f at 0x7f...>`), which differs from process to process.
# JAX's jaxpr printer already masks them in equation params; the trace context (an AxisEnv object)
# still prints one. Masked the same way, so a restarted engine computes the same key.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _mask_addresses(text: str) -> str:
    return _ADDRESS.sub(" at 0x?", text)


def _device_ids(sharding) -> list[int] | None:
    """The devices of a sharding in assignment order (a NamedSharding's repr shows the mesh's shape only)."""
    try:
        return [d.id for d in sharding._device_assignment]
    except Exception:  # not a concrete sharding (None, unspecified, an abstract mesh)
        return None


def _describe(x, sharding=None) -> str:
    ids = _device_ids(x if sharding is None else sharding)
    text = _mask_addresses(repr(x))
    return text if ids is None else f"{text} devices={ids}"


def _jaxprs(jaxpr):
    """The jaxpr and every jaxpr nested in its equations' params, each once."""
    seen, todo = set(), [jaxpr]
    while todo:
        j = todo.pop()
        if id(j) not in seen:
            seen.add(id(j))
            yield j
            todo.extend(subjaxprs(j))


def _const_bytes(const) -> bytes:
    try:
        a = np.asarray(const)
        return f"{a.dtype.str}{a.shape}".encode() + np.ascontiguousarray(a).tobytes()
    except Exception:  # not an array (e.g. a typed PRNG key): its repr is all there is
        return repr(const).encode()


def _trace_context() -> str:
    """The JAX settings that change what tracing and lowering produce (matmul precision, x64, ...),
    the same set jit keys its own caches on."""
    from jax._src import config  # no public name for it

    return _mask_addresses(repr(list(zip(config.trace_context_names(), config.trace_context(), strict=True))))


def _note_jax_cache_event(event: str, **_) -> None:
    if event == _JAX_CACHE_HIT:
        _compiling.jax_cache_hit = True
    elif event == _JAX_CACHE_REQUEST:
        _compiling.jax_cache_request = True


jax.monitoring.register_event_listener(_note_jax_cache_event)


def stores_loaded_executables() -> bool:
    """Whether an executable that JAX loaded from its own persistent cache serializes whole.

    On the CPU XLA serializes it without its kernels (jaxlib 0.11.2: the copy loads, then fails to run
    with "Function ... not found"). On CUDA it was seen whole: on an H200, 67 programs of the 8B shape
    (Triton and Mosaic GPU kernels, cuBLAS) taken from JAX's cache were stored, loaded by a new process,
    and gave the same greedy tokens. TPU and ROCm were not checked, so there too only executables
    compiled in this process are stored.
    """
    client = jax.devices()[0].client
    return client.platform == "gpu" and "cuda" in client.platform_version  # JAX's own test for CUDA


def _platform() -> list:
    devices = jax.devices()
    client = devices[0].client
    try:  # what JAX's own cache key hashes (on the CPU it tells host CPUs apart)
        from jax._src.lib import xla_client

        topology = xla_client.get_topology_for_devices(devices).fingerprint()
    except Exception:
        topology = None
    # Each process of a multi-host program keeps its own entries (a shared home directory sees them all).
    return [client.platform, client.platform_version, [d.device_kind for d in devices], len(devices),
            jax.process_count(), jax.process_index(), topology]


def reload(compiled: jax.stages.Compiled) -> jax.stages.Compiled:
    """A second loaded copy of `compiled` (serialized and loaded again onto the same devices): the same
    program, with runtime state of its own (on GPUs its own CUDA graphs). Only for executables that
    serialize whole (`stores_loaded_executables`)."""
    executable, in_tree, out_tree = serialize_executable.serialize(compiled)
    return _load(executable, in_tree, out_tree, _devices(compiled))


def _devices(compiled: jax.stages.Compiled) -> list:
    """The devices `compiled` runs on, in order (loading a copy must hand the same ones back)."""
    return list(compiled._executable._unloaded_executable.device_list)


def _load(executable: bytes, in_tree, out_tree, devices: list) -> jax.stages.Compiled:
    return serialize_executable.deserialize_and_load(executable, in_tree, out_tree, backend=devices[0].client,
                                                     execution_devices=devices)


class ExecutableCache:
    """One file per compiled program under `directory`, named by `key(traced, compiler_options)`."""

    def __init__(self, directory: str):
        self.directory = os.path.expanduser(directory)

    def key(self, traced: jax.stages.Traced, compiler_options: dict | None = None) -> str | None:
        """sha256 over everything that decides the compiled program; None if this JAX lacks an internal
        read here (the program is then compiled and not stored, rather than keyed on less).

        The jaxpr text (nested jaxprs, Pallas kernel bodies included: the printer hoists them) and the
        values of its constants, which the text shows only as shapes (RoPE frequencies are one); the
        arguments (avals, donation, shardings with device ids, layouts, committedness) and the pytrees
        around them; jit's own params (output shardings, layouts); JAX's trace context; jax/jaxlib
        versions; the platform and its devices; XLA_FLAGS; the compiler options.
        """
        try:
            parts = {
                "format": FORMAT,
                "jaxpr": _mask_addresses(str(traced.jaxpr)),
                "args": _mask_addresses(repr(traced.args_info)),
                "inputs": [_describe(t, t.sharding) for t in traced._meta_tys_flat],
                "params": {k: [_describe(x) for x in v] if isinstance(v, tuple) else _describe(v)
                           for k, v in sorted(traced._params.items()) if k != "jaxpr"},
                "trees": [str(traced.in_tree), str(traced.out_tree)],
                "outputs": [_describe(x, x.sharding) for x in jax.tree.leaves(traced.out_info)],
                "trace_context": _trace_context(),
                "versions": [jax.__version__, jaxlib.__version__],
                "platform": _platform(),
                "env": [os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", "")],
                "compiler_options": compiler_options or {},
            }
            consts = [c for jaxpr in _jaxprs(traced.jaxpr) for c in jaxpr.consts] + list(traced._consts)
        except AttributeError as e:
            logger.warning("executable cache: cannot key %s (%s); compiling it", traced.fun_name, e)
            return None
        h = hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode())
        for const in consts:
            h.update(_const_bytes(const))
        return h.hexdigest()

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}.jexe")

    def contains(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def load(self, key: str) -> jax.stages.Compiled | None:
        """The executable stored under `key`, loaded onto the devices it was compiled for; None if there
        is none or it cannot be read (truncated, corrupt, from another version, devices missing)."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f)
            if entry["format"] != FORMAT or entry["key"] != key:
                raise ValueError("an entry written for another key")
            by_id = {d.id: d for d in jax.devices()}
            devices = [by_id[i] for i in entry["device_ids"]]
            return _load(entry["executable"], entry["in_tree"], entry["out_tree"], devices)
        except FileNotFoundError:
            logger.debug("executable cache: no entry %s", key)
        except Exception as e:  # any unreadable entry is a miss: the program is compiled and stored again
            logger.info("executable cache: ignoring %s (%s: %s)", path, type(e).__name__, e)
        return None

    def compile(self, key: str, lowered: jax.stages.Lowered, compiler_options: dict | None = None
                ) -> jax.stages.Compiled:
        """`lowered.compile(compiler_options)`, then stored under `key`. Where an executable that JAX
        loaded from its own cache would be stored broken (not `stores_loaded_executables()`), only one
        that XLA compiled just now is stored: not one JAX's cache served, nor one JAX's in-memory
        caches handed back (possibly loaded from its cache earlier: on the CPU, an embedding program
        run through `jax.jit` before its warm-up was stored that way, and the entry failed in the next
        process with "Function ... not found"). A later start that compiles the program stores it."""
        _compiling.jax_cache_hit = _compiling.jax_cache_request = False
        compiled = lowered.compile(compiler_options)
        compiled_here = _compiling.jax_cache_request and not _compiling.jax_cache_hit
        if compiled_here or stores_loaded_executables():
            self.store(key, compiled)
        else:
            logger.debug("executable cache: not storing %s, which XLA did not compile just now", key)
        return compiled

    def store(self, key: str, compiled: jax.stages.Compiled) -> None:
        """Write `compiled` under `key` (atomically: a reader sees the old file or the new one, whole)."""
        try:
            executable, in_tree, out_tree = serialize_executable.serialize(compiled)
            device_ids = [d.id for d in _devices(compiled)]
            entry = dict(format=FORMAT, key=key, device_ids=device_ids, in_tree=in_tree, out_tree=out_tree,
                         executable=executable)
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
                os.replace(tmp, self._path(key))
            except BaseException:
                os.unlink(tmp)
                raise
        except Exception as e:  # e.g. a read-only directory, "Compilation does not support serialization"
            logger.info("executable cache: not storing %s (%s: %s)", key, type(e).__name__, e)


__all__ = ["ExecutableCache"]
