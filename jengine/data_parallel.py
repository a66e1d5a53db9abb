"""Data-parallel replicas on one host: independent engines on disjoint device groups, one front end.

Each replica is a whole `LLMEngine` (its own scheduler, KV cache and compiled programs) on its own
`tensor_parallel_size` consecutive devices. The front end sends each new request to the replica with
the fewest unfinished requests and steps every replica once per `step()`; as a step only launches the
device work and reads back the previous one, the replicas' device work overlaps. Embeddings (the
server's /v1/embeddings) run on replica 0.
"""

from __future__ import annotations

import dataclasses
import time

import jax

from jengine.engine import LLMEngine
from jengine.engine_config import EngineConfig
from jengine.outputs import RequestOutput
from jengine.sampling_params import SamplingParams


class DataParallelEngine:
    """`data_parallel_size` LLMEngines behind the part of LLMEngine's interface that `LLM` uses."""

    def __init__(self, config: EngineConfig, *, warmup: bool = True, progress: bool = True):
        t0 = time.perf_counter()
        dp, tp = config.data_parallel_size, config.tensor_parallel_size
        config.check_tensor_parallel(None, jax.device_count())
        devices = jax.devices()
        one = dataclasses.replace(config, data_parallel_size=1)
        self.replicas = [LLMEngine(one, warmup=warmup, progress=progress, devices=devices[i * tp : (i + 1) * tp])
                         for i in range(dp)]
        first = self.replicas[0]
        self.config, self.model_config, self.tokenizer = first.config, first.model_config, first.tokenizer
        self.sampling_defaults = first.sampling_defaults
        self.num_compiled_buckets = first.num_compiled_buckets
        self.kv_cache_tokens = sum(r.kv_cache_tokens for r in self.replicas)
        self.startup_seconds = time.perf_counter() - t0
        self._owner: dict[str, LLMEngine] = {}  # request id -> the replica running it

    @property
    def stats(self) -> dict[str, int]:
        return {key: sum(r.stats[key] for r in self.replicas) for key in self.replicas[0].stats}

    def tokenize_prompt(self, prompt):
        return self.replicas[0].tokenize_prompt(prompt)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, **kwargs) -> list[int]:
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        replica = min(self.replicas, key=lambda r: r.num_unfinished_requests())
        ids = replica.add_request(request_id, prompt, params, **kwargs)
        self._owner[request_id] = replica
        return ids

    def abort_request(self, request_id: str) -> None:
        replica = self._owner.pop(request_id, None)
        if replica is not None:
            replica.abort_request(request_id)

    def num_unfinished_requests(self) -> int:
        return sum(r.num_unfinished_requests() for r in self.replicas)

    def embed(self, token_ids: list[int]) -> list[float]:
        from jengine.entrypoints.pooling import embed

        return embed(self.replicas[0], token_ids)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def _collect(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def step(self) -> list[RequestOutput]:
        return self._collect([out for r in self.replicas for out in r.step()])

    def drain(self) -> list[RequestOutput]:
        return self._collect([out for r in self.replicas for out in r.drain()])


def build_engine(config: EngineConfig, *, progress: bool = True, devices=None, embedding_programs: bool = False):
    """The engine a config asks for: one `LLMEngine` (on `devices`, default all), or `DataParallelEngine`
    replicas when `data_parallel_size` > 1 (requests balanced across disjoint device groups).
    `embedding_programs`: as `LLMEngine` takes it (one engine only)."""
    if config.data_parallel_size > 1:
        return DataParallelEngine(config, progress=progress)
    return LLMEngine(config, progress=progress, devices=devices, embedding_programs=embedding_programs)
