"""Compiled step programs on disk, keyed before tracing, so that a warm start neither traces, lowers
nor compiles them.

JAX's persistent compilation cache (`enable_jax_cache`) keys on the lowered module,
so every start still traces and lowers every program: on an H200 most of a warm start's time
(RESULTS.md, sessions 28 and 30). This cache keys on what the trace is a function of, known before it
runs, and keeps the serialized executable: a hit costs a hash and a load. A miss is traced, lowered
and compiled as before (through JAX's cache) and then stored.

What the key covers (`ExecutableCache.key`): the program's name, the values it closes over (the model
config, the mesh) and its static arguments; its inputs (pytree structure; per leaf shape, dtype, weak
type and sharding with device ids); the source of jengine's own Python files (`code_digest`) and of
the model family's; the versions of JAX and the libraries it traces through; JAX's trace context; the
platform and its devices; XLA_FLAGS; the compiler options. It does not see a module changed at run
time without its file (a monkeypatched function, a module constant set by a script): run such code
with `compilation_cache_dir=None`, or a directory of its own. Entries live in a directory per code
digest, and only the most recently used few are kept (`ExecutableCache`).

Entries are pickles, as `jax.experimental.serialize_executable` makes them: loading one can run
code, so point the cache only at a directory you own. A read that fails in any way is a miss and a
write that fails is skipped; both are logged, neither stops the engine.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import pickle
import re
import shutil
import tempfile
import threading
from collections.abc import Iterable, Sequence

import jax
import jaxlib
from jax.experimental import serialize_executable

logger = logging.getLogger(__name__)

FORMAT = 2  # of the keys and entry files; part of the key, so a new layout never reads an old file
# JAX records both in the thread that asked to compile: a compile that went to its persistent cache
# (a request), and one that the cache served (a hit). A compile that records neither was served from
# JAX's in-memory caches: the same program, traced and compiled earlier in this process.
_JAX_CACHE_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"
_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_compiling = threading.local()  # .jax_cache_request / .jax_cache_hit: what this thread's last compile did
# Libraries whose code runs while a program is traced and lowered (besides jax, jaxlib and their
# plugins, found by name): a new version may build another program from the same source.
_TRACED_THROUGH = ("flax", "numpy", "ml-dtypes")

# Object reprs name their address (`<function f at 0x7f...>`), which differs from process to process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_VERSION_CHARS = 16  # of the code digest, naming a version's directory
_VERSION_DIR = re.compile(f"[0-9a-f]{{{_VERSION_CHARS}}}")


def _mask_addresses(text: str) -> str:
    return _ADDRESS.sub(" at 0x?", text)


def _device_ids(sharding) -> list[int] | None:
    """The devices of a sharding in assignment order (a NamedSharding's repr shows the mesh's shape only)."""
    try:
        return [d.id for d in sharding._device_assignment]
    except Exception:  # not a concrete sharding (None, unspecified, an abstract mesh)
        return None


def _describe_sharding(sharding) -> str:
    ids = _device_ids(sharding)
    text = _mask_addresses(repr(sharding))
    return text if ids is None else f"{text} devices={ids}"


def _describe_leaf(x) -> str:
    if isinstance(x, jax.ShapeDtypeStruct):
        aval = jax.core.ShapedArray(x.shape, x.dtype, weak_type=x.weak_type)
    else:
        try:
            aval = jax.typeof(x)
        except TypeError:  # not an array
            return f"value {_mask_addresses(repr(x))}"
    sharding = getattr(x, "sharding", None)
    return f"{aval.str_short()} weak={aval.weak_type} {'host' if sharding is None else _describe_sharding(sharding)}"


def describe(tree) -> str:
    """A program input as far as the compiled program depends on it: the pytree's structure and, per
    leaf, shape, dtype, weak type and sharding (with device ids; `host` for a numpy array). An array
    and a `jax.ShapeDtypeStruct` of its shape, dtype and sharding describe alike."""
    leaves, treedef = jax.tree.flatten(tree)
    return json.dumps([str(treedef), [_describe_leaf(x) for x in leaves]])


def _package_files() -> dict[str, str]:
    """jengine's Python files (the engine, models, kernels): real path -> name inside its package."""
    import jengine
    import jengine.kernels_pallas
    import jengine.models

    files = {}
    for package in (jengine, jengine.models, jengine.kernels_pallas):
        for root in package.__path__:
            root = os.path.realpath(root)
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = [d for d in dirnames if d != "__pycache__"]
                for name in filenames:
                    if name.endswith(".py"):
                        path = os.path.join(dirpath, name)
                        files.setdefault(path, f"{package.__name__}/{os.path.relpath(path, root)}")
    return files


def _file_hash(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@functools.cache
def code_digest() -> str:
    """sha256 over the source of jengine's Python files (an edit to the engine, a model or a kernel
    makes every key new) and the versions of the libraries that trace and lower them. Once a process."""
    files = sorted((name, _file_hash(path)) for path, name in _package_files().items())
    versions = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("jax") or name in _TRACED_THROUGH:
            versions[name] = dist.version
    versions.update(jax=jax.__version__, jaxlib=jaxlib.__version__)  # as imported
    return hashlib.sha256(json.dumps([files, sorted(versions.items())]).encode()).hexdigest()


def _source_file(function) -> str | None:
    """The file that defines `function` (through wrappers and partials), or None for one without."""
    while isinstance(function, functools.partial):
        function = function.func
    try:
        path = inspect.getsourcefile(inspect.unwrap(function))
    except TypeError:  # a builtin, a C function, a callable object's class without a file
        path = None
    if path is None:
        path = getattr(inspect.getmodule(function), "__file__", None)
    return None if path is None else os.path.realpath(path)


def source_digest(functions: Iterable) -> str:
    """sha256 over the files that define `functions` (a model family registered from outside jengine
    is not in `code_digest`); a function without a file counts by its repr."""
    parts = set()
    for function in functions:
        path = _source_file(function)
        parts.add(_file_hash(path) if path is not None and os.path.isfile(path) else _mask_addresses(repr(function)))
    return hashlib.sha256(json.dumps(sorted(parts)).encode()).hexdigest()


def _trace_context() -> str:
    """The JAX settings that change what tracing and lowering produce (matmul precision, x64, ...),
    the same set jit keys its own caches on."""
    from jax._src import config  # no public name for it

    return _mask_addresses(repr(list(zip(config.trace_context_names(), config.trace_context(), strict=True))))


def _describe_closure(x) -> str:
    """A value a program closes over by its repr; a mesh with its devices in order."""
    if isinstance(x, jax.sharding.Mesh):
        return f"{_mask_addresses(repr(x))} devices={[d.id for d in x.devices.flat]}"
    return _mask_addresses(repr(x))


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


JAX_CACHE_MAX_BYTES = 4 << 30  # JAX's own cache directory: least recently used entries beyond this are deleted


def enable_jax_cache(path: str) -> None:
    """JAX's persistent compilation cache in `path`, so a restart skips XLA compilation where this cache
    misses (first user of the process wins).

    Every program is kept, however quick its compile: with a 0.5 s floor, 21 of the 84 programs of the
    default 8B buckets were compiled again on every warm start (H200, benchmarks/startup.py).

    JAX's cache is bounded (`JAX_CACHE_MAX_BYTES`, least recently used out) unless the process set its own
    bound (`jax_compilation_cache_max_size`, or the JAX_COMPILATION_CACHE_MAX_SIZE variable): each version of
    the code or the model writes new entries, which would otherwise pile up without end (jengine's own
    executables prune themselves: `ExecutableCache.keep_versions`)."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        if jax.config.jax_compilation_cache_max_size == -1:
            jax.config.update("jax_compilation_cache_max_size", JAX_CACHE_MAX_BYTES)


class ExecutableCache:
    """One file per compiled program, named by its `key`, in a directory per version of jengine's code
    under `root` (`root/<code digest>/`): every key changes with the code, so the entries of earlier
    versions are never read again. The first store of a process keeps the `keep_versions` most recently
    used version directories, the current one included, and deletes the others."""

    def __init__(self, root: str, keep_versions: int = 3):
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        self.root = os.path.expanduser(root)
        self.directory = os.path.join(self.root, code_digest()[:_VERSION_CHARS])
        self.keep_versions = keep_versions
        self._pruned = False
        try:  # a version in use counts as recent (directory mtimes order them)
            os.utime(self.directory)
        except OSError:
            pass

    def _prune(self) -> None:
        """Delete the version directories beyond the `keep_versions` most recently used."""
        self._pruned = True
        try:
            versions = [e for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)
                        and _VERSION_DIR.fullmatch(e.name) and e.path != self.directory]
        except OSError:
            return
        versions.sort(key=lambda e: e.stat(follow_symlinks=False).st_mtime, reverse=True)
        for old in versions[self.keep_versions - 1:]:
            logger.info("executable cache: removing %s (entries of another version of jengine)", old.path)
            shutil.rmtree(old.path, ignore_errors=True)

    def key(self, program: str, inputs: Sequence[str], *, closure=(), statics=(),
            compiler_options: dict | None = None) -> str | None:
        """sha256 naming one compiled program, computed before it is traced: `program` (the function's
        name), `inputs` (`describe` of each argument), `closure` (the values the function closes over:
        the model config, the mesh, the model family's `source_digest`) and `statics` (its static
        arguments), each by its repr, with everything the module docstring lists. None if this JAX
        lacks an internal read here (the program is then compiled and not stored)."""
        try:
            context = _trace_context()
        except (AttributeError, ImportError, TypeError) as e:
            logger.warning("executable cache: cannot key %s (%s); compiling it", program, e)
            return None
        parts = {
            "format": FORMAT,
            "code": code_digest(),
            "program": program,
            "closure": [_describe_closure(x) for x in closure],
            "statics": _mask_addresses(repr(tuple(statics))),
            "inputs": list(inputs),
            "trace_context": context,
            "platform": _platform(),
            "env": [os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", "")],
            "compiler_options": compiler_options or {},
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()

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
            if not self._pruned:
                self._prune()
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


__all__ = ["ExecutableCache", "code_digest", "describe", "source_digest"]
