"""Cold start in parallel: helper processes build programs into the executable cache.

A cold start is bound by one thread tracing and lowering the forwards, Python that holds the GIL (on
an H200, 46 of a 59.5 s engine start, most of it lowering their Mosaic GPU kernels; RESULTS.md, session
31), while the compile pool waits for work. Threads cannot share that; processes can. Each helper
takes a share of the forwards the executable cache lacks: it rebuilds the runner over the params'
shapes (no weights), keys each forward exactly as warm-up does, and traces, lowers, compiles and stores
it (and `jengine serve`'s embedding programs, which `pooling.warmup` then loads). Warm-up builds its own
share meanwhile, then loads what the helpers stored; a program a helper did not store (it failed, timed
out, or keyed it differently) is built by the engine as usual, so helpers can only save time, never
change what runs. Handing them a share of the sampling programs too (the main thread's 102 of them took
31.6 of its 37.9 s of lowering) halved that lowering but then left it waiting as long for the helpers, and
the cold start did not move (H200s, session 46: cold starts 45-58 s against 53-56 s, and 65 against 65 s
on a slower host). The likely bound is the host's cores (the compile pool and three helpers on 16): the
main thread lowered each sampling program in 0.46-0.50 s there, 0.31 s with less beside it.

Each helper has its own GPU client, and XLA's autotuner runs every GEMM it compiles on the device, so a
helper needs device memory outside the engine's allocator (which preallocates 92% of the GPU). On an
H100 (80 GB, ~6 GiB left) the 8B start-up's helpers, each with a growing pool, reached 2.2 GiB each (3.1
alone); three of them ran out of memory there (one or two of three finished; the engine built the rest
itself). So helpers allocate as they go (1.7-2.2 GiB each, three of three finished), and `memory_room`
bounds their number (two on that H100). The cold starts of that machine varied too much (56-74 s
for one code) to show what either saved (RESULTS.md, session 37).

Helpers are plain `python -m jengine.build_helpers` processes (not multiprocessing), so a user's script
needs no `__main__` guard for them. They start only on GPUs (a TPU host's chips belong to one process,
and on the CPU they would take the cores the compile pool needs), on one device (no mesh), with the
executable cache on. They see the environment and module path, not JAX settings the engine's process
changed in code (`jax.config.update`): where such a setting enters a program's key, their programs are
not the engine's, and the engine builds its own (correct, not faster).
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time

import jax

from jengine import kv_cache

logger = logging.getLogger(__name__)

MAX_HELPERS = 3
MIN_PROGRAMS_EACH = 3  # a helper's start (imports, its device client; not timed alone) must buy at least this many
CORES_PER_HELPER = 4  # each helper's XLA compiles, beside the main process's pool
TIMEOUT_S = 900.0
# A helper's device memory beyond twice the largest weight (the autotuner's operands): its CUDA context, the
# cuBLAS workspaces and the activations of the largest bucket. 8B on an H100: 0.5 + 2 x 0.98 = 2.46 GiB
# against 1.7-2.2 seen per helper.
HELPER_BASE_BYTES = 1 << 29
ENGINE_OVERHEAD_BYTES = 1 << 30  # the engine's own use outside its allocator's pool (0.7 GiB on that H100)


def helper_count(missing: int, cpus: int, platform: str, single_device: bool, room: int | None = None) -> int:
    """How many helpers warm-up starts for `missing` programs (it builds a share itself); `room`: how many the
    device's memory holds (`memory_room`; None: no bound)."""
    if platform != "gpu" or not single_device:
        return 0
    bound = MAX_HELPERS if room is None else min(MAX_HELPERS, room)
    return max(0, min(bound, cpus // CORES_PER_HELPER, missing // MIN_PROGRAMS_EACH - 1))


def memory_room(params, device=None) -> int | None:
    """How many helpers fit in the device memory the engine's allocator leaves: the driver's total less the
    allocator's limit and the engine's own overhead, over one helper's need (`HELPER_BASE_BYTES` and twice
    the largest of `params`). None where the device does not say (no allocator limit: XLA's VMM allocator,
    which takes memory as it goes)."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    total = kv_cache.cuda_total_memory(device) if getattr(device, "platform", None) == "gpu" else None
    if not stats or "bytes_limit" not in stats or total is None:
        return None
    largest = max((x.size * x.dtype.itemsize for x in jax.tree.leaves(params) if hasattr(x, "dtype")), default=0)
    room = total - int(stats["bytes_limit"]) - ENGINE_OVERHEAD_BYTES
    return max(0, room // (HELPER_BASE_BYTES + 2 * largest))


def shares(items: list, helpers: int) -> list[list]:
    """`items` split between the main process (the first share) and `helpers` helpers, round-robin
    among the helpers. The main process takes half a helper's share: it also lowers the sampling and
    prompt-logprob programs, and its compile pool serves them all."""
    if helpers <= 0:
        return [list(items)]
    mine = len(items) // (2 * helpers + 1)
    rest = list(items[mine:])
    return [list(items[:mine])] + [rest[i::helpers] for i in range(helpers)]


def start(builder, buckets: list[tuple[int, int]], forwards: list[tuple], embedding_lengths=(),
          helpers: int | None = None) -> tuple[Helpers | None, list[tuple], list[tuple]]:
    """Hand a share of the forwards the executable cache of `builder` (a `warmup.ProgramBuilder`)
    lacks to helper processes (`helpers` of them; default `helper_count`). `forwards` are warm-up's
    builds of `buckets`, in order, as `_start_builds` takes them. When any forward is missing (a cold
    start), the embedding programs of `embedding_lengths` the cache lacks go to the helpers too.
    Returns the helpers (None: none started), the forwards to build now, and those to load once the
    helpers are done."""
    cache = builder.executable_cache
    if cache is None:
        return None, forwards, []
    # (job, its forward's build or None) per program missing: forwards first, so that the engine's own
    # share (the first) is forwards; an embedding program in it is left to `pooling.warmup`
    missing = [(("forward", bucket), build) for bucket, build in zip(buckets, forwards)
               if build[1] is not None and not cache.contains(build[1])]
    if missing:
        jobs = (("hidden_states", n) for n in embedding_lengths)
        missing += [(job, None) for job in jobs if not cache.contains(builder.job_build(job)[1])]
    if helpers is None:
        single = builder.runner.mesh is None
        room = memory_room(builder.runner.params) if single and jax.default_backend() == "gpu" else None
        helpers = helper_count(len(missing), os.cpu_count() or 1, jax.default_backend(), single, room)
    theirs = [share for share in shares(missing, helpers)[1:] if share]
    if not theirs:
        return None, forwards, []
    later = {build[0] for share in theirs for _, build in share if build is not None}
    handle = Helpers(builder, [[job for job, _ in share] for share in theirs])
    return handle, [b for b in forwards if b[0] not in later], [b for b in forwards if b[0] in later]


class Helpers:
    """Helper processes building `jobs_per_helper` programs of `builder`'s runner into its executable
    cache (`encode_jobs`); `wait` for them, or `stop` them."""

    def __init__(self, builder, jobs_per_helper: list[list[tuple]]):
        runner, cache = builder.runner, builder.executable_cache
        spec = dict(cfg=runner.cfg, ecfg=runner.ecfg, num_pages=runner.num_pages,
                    params=jax.tree.map(_shape_of, runner.params), root=cache.root,
                    keep_versions=cache.keep_versions, jax_cache_dir=jax.config.jax_compilation_cache_dir)
        fd, self._spec_path = tempfile.mkstemp(prefix="jengine-helpers-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(spec, f, protocol=pickle.HIGHEST_PROTOCOL)
        # The helpers search this process's module path, less its working-directory entry, and not their
        # own working directory (-P): a `jengine` directory there (a source checkout) is not the package.
        path = os.pathsep.join(p for p in sys.path if p)
        # Their allocator takes device memory as it goes and gives it back (the platform allocator, not a
        # growing pool): the autotuner's buffers of one program at a time, not the high mark of all of them.
        env = {**os.environ, "PYTHONPATH": path, "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
               "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
        self._procs = []
        for jobs in jobs_per_helper:
            log = tempfile.TemporaryFile()
            proc = subprocess.Popen([sys.executable, "-P", "-m", "jengine.build_helpers", self._spec_path,
                                     encode_jobs(jobs)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
            self._procs.append((proc, log, jobs))

    @property
    def count(self) -> int:
        return len(self._procs)

    def wait(self, timeout: float = TIMEOUT_S) -> int:
        """Wait for every helper (those past `timeout` are killed); returns how many finished cleanly.
        A failure is logged; the engine then builds that helper's programs itself."""
        deadline, ok = time.monotonic() + timeout, 0
        try:
            for proc, log, jobs in self._procs:
                try:
                    code = proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    code = proc.wait()
                    logger.warning("build helper for %d programs timed out after %.0f s", len(jobs), timeout)
                if code == 0:
                    ok += 1
                else:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-2000:]
                    logger.warning("build helper for %d programs exited with %s; the engine builds them:\n%s",
                                   len(jobs), code, tail)
                log.close()
        finally:
            self.stop()
        return ok

    def stop(self) -> None:
        """Kill the helpers still running and remove their spec (idempotent)."""
        for proc, _, _ in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if os.path.exists(self._spec_path):
            os.unlink(self._spec_path)


def encode_jobs(jobs: list[tuple]) -> str:
    """`("forward", (T, S))` and `("hidden_states", n)` jobs as one command-line argument."""
    return ";".join(f"forward:{what[0]},{what[1]}" if kind == "forward" else f"{kind}:{what}" for kind, what in jobs)


def decode_jobs(text: str) -> list[tuple]:
    jobs = []
    for item in text.split(";"):
        kind, what = item.split(":")
        jobs.append((kind, tuple(int(v) for v in what.split(",")) if kind == "forward" else int(what)))
    return jobs


def _shape_of(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") and hasattr(x, "dtype") else x


def main(argv: list[str]) -> None:
    from jengine.executable_cache import ExecutableCache, enable_jax_cache
    from jengine.runner import ModelRunner
    from jengine.warmup import ProgramBuilder

    spec_path, arg = argv
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    if spec["jax_cache_dir"]:
        enable_jax_cache(spec["jax_cache_dir"])
    on = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # where the engine's params live (no mesh)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on)
                          if isinstance(x, jax.ShapeDtypeStruct) else x, spec["params"])
    cache = ExecutableCache(spec["root"], spec["keep_versions"])
    runner = ModelRunner(spec["cfg"], spec["ecfg"], params, spec["num_pages"], 0)
    ProgramBuilder(runner, cache).build_jobs(decode_jobs(arg), CORES_PER_HELPER)


if __name__ == "__main__":
    main(sys.argv[1:])
