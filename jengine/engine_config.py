"""Engine configuration: one frozen dataclass with vLLM's names, validated at construction."""

from __future__ import annotations

import dataclasses
import os

from jengine.buckets import default_seq_buckets, default_token_buckets
from jengine.config import ModelConfig, normalize_dtype
from jengine.quantization import check_quantization
from jengine.sampling_params import check_bool, plain_scalar

PREEMPTION_MODES = ("recompute", "swap")
# vLLM's names: "auto" keeps the model's dtype; "fp8" is e4m3 (8-bit K/V, saturated, no scale)
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
SCHEDULING_POLICIES = ("fcfs", "priority")
PAGE_SIZES = (8, 16, 32, 64, 128)  # block_size: tokens per KV page


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model. `None` fields are filled from the model by `resolve`."""

    model: str
    dtype: str | None = None  # None / "auto": the checkpoint's dtype
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) | "fp8" / "fp8_e4m3" | "fp8_e5m2"
    load_format: str = "auto"
    # vLLM's: "fp8" quantizes the linear layers' weights to e4m3 with per-column scales at load time
    # (`jengine.quantization`); None keeps the checkpoint's weights
    quantization: str | None = None
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # 256 on an accelerator, 8 on the CPU
    max_num_batched_tokens: int | None = None
    # Tokens per KV page. On an H200, 64-token pages made the attention kernels 5-11% faster (one bulk copy
    # per page) and the 8B throughput run 0.7-4.5% faster on some machines (sessions 15-21), but the
    # batch-64 latency run slower on others (session 19: 6.87 against 5.43 ms), because XLA re-recorded the
    # forward's CUDA graph after every step and took longer over it with 64-token pages. Since session 22
    # the runner keeps the graph's buffers in place (ModelRunner), and with 64-token pages the batch-64 run
    # took 5.28 against the old code's 5.55 ms; but throughput gained nothing measurable on two machines
    # (+0.5%, -0.03%). So the default stays vLLM's 16 (RESULTS.md, sessions 15-22).
    # Prefix caching shares whole pages: smaller pages share shorter prefixes.
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    swap_space: float = 0.0  # GiB of host memory for swapped-out KV pages
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # While queued prompts fill a step's budget, steps run no decodes (scheduler.py): a burst of prompts ends
    # sooner and decodes run in full batches after it; decodes stall during the burst. Off: every step runs
    # the decodes first and prompt chunks in the rest of the budget (vLLM v1). None picks by entry point, as
    # vLLM picks some defaults by its usage context: on for the offline `LLM` (a batch handed over at once,
    # where only its end counts: +3.4-4.7% output tok/s on the throughput run on four H200s, -0.4% on the
    # chat-like one; RESULTS.md sessions 50-51), off for an engine built otherwise (`AsyncLLM`, `jengine
    # serve`), whose running streams a burst of arrivals would stall (400 requests at once: TPOT +6%).
    prefill_first: bool | None = None
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    compilation_cache_dir: str | None = "~/.cache/jengine/xla"  # JAX's and jengine's executable caches; None: off
    token_buckets: tuple[int, ...] | None = None
    seq_buckets: tuple[int, ...] | None = None
    tensor_parallel_size: int = 1  # devices one model is split over (heads, MLP columns, vocabulary)
    data_parallel_size: int = 1  # independent engine replicas, each on its own tensor_parallel_size devices
    # vLLM's --generation-config: "auto" takes EOS ids and sampling defaults from the model directory's
    # generation_config.json (when there is one), "vllm" ignores it, a directory path reads the one there.
    generation_config: str = "auto"
    # vLLM's --override-generation-config: sampling keys of a generation config (temperature, top_p, top_k,
    # min_p, repetition_penalty, max_new_tokens) set over the file's defaults; a null unsets one.
    override_generation_config: dict | None = dataclasses.field(default=None, hash=False)

    def __post_init__(self):
        for field in dataclasses.fields(self):  # numpy scalars as the Python values they hold
            object.__setattr__(self, field.name, plain_scalar(getattr(self, field.name)))
        for name in ("model", "generation_config"):
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a preset name or a checkpoint directory, got {self.model!r}")

        def positive_int(name, value, allow_none=True):
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        positive_int("max_model_len", self.max_model_len)
        positive_int("max_num_seqs", self.max_num_seqs)
        positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override)
        positive_int("tensor_parallel_size", self.tensor_parallel_size, allow_none=False)
        positive_int("data_parallel_size", self.data_parallel_size, allow_none=False)
        if (not isinstance(self.block_size, int) or isinstance(self.block_size, bool)
                or self.block_size not in PAGE_SIZES):
            raise ValueError(f"block_size must be one of {', '.join(map(str, PAGE_SIZES))}, got {self.block_size!r}")
        for name in ("gpu_memory_utilization", "swap_space"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory holding generation_config.json, "
                             f"got {self.generation_config!r}")
        override = self.override_generation_config
        if override is not None:
            if not isinstance(override, dict) or not all(isinstance(k, str) for k in override):
                raise ValueError("override_generation_config must be None or a dict of generation-config keys "
                                 f"(e.g. {{'temperature': 0.7}}), got {override!r}")
            object.__setattr__(self, "override_generation_config", dict(override))  # the caller's stays theirs
        if self.compilation_cache_dir is not None and not isinstance(self.compilation_cache_dir, str):
            raise ValueError(f"compilation_cache_dir must be a path or None, got {self.compilation_cache_dir!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not self.swap_space >= 0:  # NaN too
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        check_quantization(self.quantization)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        if self.prefill_first is not None:
            check_bool("prefill_first", self.prefill_first)
        if self.dtype not in (None, "auto"):
            object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        for name in ("token_buckets", "seq_buckets"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                    raise ValueError(f"{name} must be a non-empty list of positive integers, got {value!r}")
                value = [plain_scalar(v) for v in value]
                if not value or any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in value):
                    raise ValueError(f"{name} must be a non-empty list of positive integers, got {value!r}")
                object.__setattr__(self, name, tuple(sorted(set(value))))

    def resolve(self, model_cfg: ModelConfig, backend: str = "gpu", num_devices: int | None = None) -> EngineConfig:
        """Fill the `None` fields from the model and the backend, and check the combination.

        On the CPU (tests, notebooks) the defaults are small so start-up compiles few buckets.
        """
        self.check_tensor_parallel(model_cfg, num_devices)
        on_cpu = backend == "cpu"
        max_len = self.max_model_len or model_cfg.max_position_embeddings
        max_seqs = self.max_num_seqs or (8 if on_cpu else 256)
        if max_len > model_cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_len} exceeds the model's max_position_embeddings "
                f"({model_cfg.max_position_embeddings})")
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 128 if on_cpu else 2048
            batched = max(batched, max_seqs) if self.enable_chunked_prefill else max(batched, max_len)
        if not self.enable_chunked_prefill and batched < max_len:
            raise ValueError(
                f"max_num_batched_tokens ({batched}) must be >= max_model_len ({max_len}) when chunked "
                "prefill is disabled, or no long prompt could ever be scheduled")
        if batched < max_seqs:
            raise ValueError(f"max_num_batched_tokens ({batched}) must be >= max_num_seqs ({max_seqs})")
        token_buckets = self.token_buckets or tuple(default_token_buckets(batched))
        seq_buckets = self.seq_buckets or tuple(default_seq_buckets(max_seqs))
        if max(token_buckets) < batched:
            raise ValueError(f"the largest token bucket ({max(token_buckets)}) must be >= "
                             f"max_num_batched_tokens ({batched})")
        if max(seq_buckets) < max_seqs:
            raise ValueError(f"the largest sequence bucket ({max(seq_buckets)}) must be >= max_num_seqs ({max_seqs})")
        return dataclasses.replace(self, max_model_len=max_len, max_num_seqs=max_seqs, max_num_batched_tokens=batched,
                                   token_buckets=token_buckets, seq_buckets=seq_buckets,
                                   prefill_first=bool(self.prefill_first))

    def check_tensor_parallel(self, model_cfg: ModelConfig | None, num_devices: int | None) -> None:
        """tensor_parallel_size must divide the device count and the model's query heads; the replicas
        (data_parallel_size of them, tensor_parallel_size devices each) must fit on the devices."""
        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        if num_devices is not None and num_devices % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the number of devices ({num_devices})")
        if num_devices is not None and dp * tp > num_devices:
            raise ValueError(f"data_parallel_size={dp} replicas of tensor_parallel_size={tp} devices need {dp * tp} "
                             f"devices; there are {num_devices}")
        if model_cfg is not None and model_cfg.num_attention_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the number of query heads "
                             f"({model_cfg.num_attention_heads})")

    def cache_dtype(self, model_dtype):
        """The KV cache's dtype for a model computing in `model_dtype`: that dtype, or an 8-bit float's
        name (anything `jnp.dtype` takes; this module stays free of jax)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)
