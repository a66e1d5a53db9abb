"""`jengine serve --data-parallel-size N`: each replica an engine process of its own (`EngineProcesses`),
on its own device group, behind one engine's interface; `start_engine` picks that or one `EngineProcess`.

In one process (`jengine.data_parallel.DataParallelEngine`) the replicas' host work runs in turn on one
GIL; here it runs in parallel, and the replicas start side by side (RESULTS.md, session 30).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from jengine.engine_core import POLL_SECONDS, EngineProcess, RequestError
from jengine.outputs import RequestOutput


def replica_devices(index: int, size: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for data-parallel replica `index` of `size` GPUs each, among `visible` (the
    server's CUDA_VISIBLE_DEVICES; None: every GPU, numbered from 0)."""
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else None
    group = list(range(index * size, (index + 1) * size))
    if ids is None:
        return ",".join(map(str, group))
    if group[-1] >= len(ids):
        raise ValueError(f"data-parallel replica {index} needs GPUs {group[0]}..{group[-1]} of "
                         f"CUDA_VISIBLE_DEVICES={visible!r}, which lists {len(ids)}")
    return ",".join(ids[i] for i in group)


def pin_replica(index: int, size: int):
    """In a replica's child, before JAX starts: its devices. On GPUs the process sees only its group
    (CUDA_VISIBLE_DEVICES, so JAX's allocator takes memory on those alone); elsewhere (the CPU's host
    devices) it takes its slice of the devices it sees. Returns the devices to build on (None: all)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = replica_devices(index, size, os.environ.get("CUDA_VISIBLE_DEVICES"))
    import jax

    if jax.default_backend() == "gpu":
        return None
    devices = jax.devices()[index * size : (index + 1) * size]
    if len(devices) < size:
        raise ValueError(f"data-parallel replica {index} needs {size} device(s); this process sees "
                         f"{len(jax.devices())}")
    return devices


def _device_census() -> tuple[str, int]:
    """In a probe process: (platform, number of devices) as JAX sees them, taking no device memory."""
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import jax

    return jax.default_backend(), jax.device_count()


def start_engine(config, *, progress: bool = True, stats: bool = False):
    """The server's engine in child processes: an `EngineProcesses` replica per process where the devices
    allow it, else one `EngineProcess` (replicas on TPUs share it: one process holds a host's chips).
    With several replicas a short-lived probe process first counts the devices (this process starts no
    JAX backend), so that replicas that cannot fit are refused before any child starts."""
    if config.data_parallel_size > 1:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            platform, num_devices = pool.apply(_device_census)
        config.check_tensor_parallel(None, num_devices)
        if platform != "tpu":
            return EngineProcesses(config, progress=progress, stats=stats)
    return EngineProcess(config, progress=progress, stats=stats)


class EngineProcesses:
    """`data_parallel_size` replicas, each an `EngineProcess` of its own on its own device group, behind
    one engine's interface: the replicas' host work runs in parallel, not in turn on one GIL as in one
    process (`DataParallelEngine`). A new request goes to the replica with the fewest unfinished ones;
    embeddings run on replica 0. The children start in parallel; if one cannot, the others are stopped
    and its error is raised."""

    def __init__(self, config, *, progress: bool = True, stats: bool = False, startup_timeout: float | None = None):
        t0 = time.perf_counter()
        dp, tp = config.data_parallel_size, config.tensor_parallel_size
        one = dataclasses.replace(config, data_parallel_size=1)
        self._notify = threading.Event()
        with ThreadPoolExecutor(dp) as pool:
            jobs = [pool.submit(EngineProcess, one, progress=progress and i == 0, stats=stats,
                                startup_timeout=startup_timeout, replica=(i, tp), notify=self._notify)
                    for i in range(dp)]
            started, errors = [], []
            for job in jobs:
                try:
                    started.append(job.result())
                except BaseException as e:  # noqa: BLE001 - raised below, after the others are stopped
                    errors.append(e)
        if errors:
            for replica in started:
                replica.close()
            raise errors[0]
        self.replicas: list[EngineProcess] = started
        first = started[0]
        self.config, self.model_config = first.config, first.model_config
        self.sampling_defaults = first.sampling_defaults
        self.num_compiled_buckets, self.embedding_programs = first.num_compiled_buckets, first.embedding_programs
        self.kv_cache_tokens = sum(r.kv_cache_tokens for r in started)
        self.startup_seconds = time.perf_counter() - t0
        self._owner: dict[str, EngineProcess] = {}  # request id -> the replica running it

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    def add_request(self, request_id: str, prompt, params=None, **kwargs) -> None:
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        replica = min(self.replicas, key=lambda r: r.num_unfinished_requests())
        replica.add_request(request_id, prompt, params, **kwargs)
        self._owner[request_id] = replica

    def abort_request(self, request_id: str) -> None:
        replica = self._owner.pop(request_id, None)
        if replica is not None:
            replica.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def step(self) -> list[RequestOutput | RequestError]:
        """The outputs that arrived from any replica, waiting at most POLL_SECONDS for the first."""
        self._notify.clear()  # before looking: whatever arrives from here on sets it again
        outputs = self._collect()
        if not outputs and self._notify.wait(POLL_SECONDS):
            self._notify.clear()
            outputs = self._collect()
        for out in outputs:
            if isinstance(out, RequestError) or out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def _collect(self) -> list:
        return [out for replica in self.replicas for out in replica.step(timeout=0)]

    def drain(self) -> list:
        return []

    def embed(self, token_ids: list[int]) -> list[float]:
        return self.replicas[0].embed(token_ids)

    def metrics_snapshot(self) -> dict | None:
        from jengine.metrics import merge_snapshots

        return merge_snapshots([r.metrics_snapshot() for r in self.replicas])

    def close(self, timeout: float = 30.0) -> None:
        for replica in self.replicas:
            replica.close(timeout)
