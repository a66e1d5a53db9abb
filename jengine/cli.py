"""`jengine` command line: generate, convert, serve."""

from __future__ import annotations

import argparse
import json
import os
import sys

from jengine.engine_config import KV_CACHE_DTYPES, PAGE_SIZES, EngineConfig
from jengine.presets import DEFAULT_MODEL
from jengine.quantization import QUANTIZATIONS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM's."""
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES),
                        help="K/V pages in the model's dtype (auto) or 8-bit floats (fp8 = fp8_e4m3, fp8_e5m2)")
    parser.add_argument("--quantization", "-q", default=None, choices=QUANTIZATIONS,
                        help="quantize the linear layers' weights at load time (fp8: e4m3, a scale per output column)")
    parser.add_argument("--load-format", default="auto", help="auto | safetensors | orbax | dummy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default 256 (8 on the CPU)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default 2048 (128 on the CPU)")
    parser.add_argument("--block-size", type=int, default=EngineConfig.block_size, choices=PAGE_SIZES,
                        help="tokens per KV page")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--swap-space", type=float, default=0.0, help="GiB of host memory for preempted KV")
    parser.add_argument("--preemption-mode", default="recompute", choices=("recompute", "swap"))
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--prefill-first", action=argparse.BooleanOptionalAction, default=None,
                        help="while queued prompts fill a step's --max-num-batched-tokens, steps run no decodes: "
                             "a burst of prompts (an offline batch) ends sooner, decodes stall during it "
                             "(default: on for `generate`, off for `serve`)")
    parser.add_argument("--compilation-cache-dir", default=EngineConfig.compilation_cache_dir,
                        help="where compiled programs are kept between starts (JAX's cache and jengine's "
                             f"executables; default {EngineConfig.compilation_cache_dir}); 'none' turns it off")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="devices to split the model over (must divide the device count and the query heads)")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="engine replicas, each on its own --tensor-parallel-size devices")
    parser.add_argument("--generation-config", default=EngineConfig.generation_config,
                        help="where EOS ids and default sampling parameters come from: 'auto' (the model "
                             "directory's generation_config.json, if any), 'vllm' (none: jengine's defaults) "
                             "or a directory holding a generation_config.json")
    parser.add_argument("--override-generation-config", type=_json_object, default=None, metavar="JSON",
                        help="sampling keys set over the generation config's, e.g. "
                             "'{\"temperature\": 0.7, \"max_new_tokens\": 512}' (null unsets one)")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_multihost_args(parser: argparse.ArgumentParser) -> None:
    """Multi-host flags; each falls back to its JENGINE_* environment variable (as set on pods)."""
    parser.add_argument("--coordinator-address", default=None,
                        help="multi-host: host:port of process 0 (default $JENGINE_COORDINATOR_ADDRESS)")
    parser.add_argument("--num-processes", type=int, default=None,
                        help="multi-host: processes (hosts) in the run (default $JENGINE_NUM_PROCESSES)")
    parser.add_argument("--process-id", type=int, default=None,
                        help="multi-host: this process's index (default $JENGINE_PROCESS_ID)")


def multihost_settings(args: argparse.Namespace) -> tuple[str | None, int | None, int | None]:
    """(coordinator address, number of processes, process id): flags first, else the environment."""
    def flag_or_env(value, name, kind=str):
        if value is not None or not os.environ.get(name):
            return value
        try:
            return kind(os.environ[name])
        except ValueError:
            raise ValueError(f"${name} must be an integer, got {os.environ[name]!r}") from None

    return (flag_or_env(args.coordinator_address, "JENGINE_COORDINATOR_ADDRESS"),
            flag_or_env(args.num_processes, "JENGINE_NUM_PROCESSES", int),
            flag_or_env(args.process_id, "JENGINE_PROCESS_ID", int))


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=None if args.dtype == "auto" else args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                quantization=args.quantization,
                load_format=args.load_format, seed=args.seed,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                gpu_memory_utilization=args.gpu_memory_utilization, swap_space=args.swap_space,
                preemption_mode=args.preemption_mode, enable_prefix_caching=args.enable_prefix_caching,
                enable_chunked_prefill=args.enable_chunked_prefill, prefill_first=args.prefill_first,
                tensor_parallel_size=args.tensor_parallel_size,
                data_parallel_size=args.data_parallel_size, generation_config=args.generation_config,
                override_generation_config=args.override_generation_config,
                compilation_cache_dir=None if args.compilation_cache_dir.lower() in ("", "none")
                else args.compilation_cache_dir)


def _generate(args: argparse.Namespace) -> int:
    from jengine import distributed

    distributed.initialize(*multihost_settings(args))
    from jengine import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    prompts = args.prompt or ["Hello, my name is", "The capital of France is", "JAX compiles"]
    outputs = llm.generate(prompts, params)
    if not distributed.is_main_process():  # every process computed the same; one reports
        return 0
    for out in outputs:
        completion = out.outputs[0]
        print(json.dumps({"prompt": out.prompt, "text": completion.text, "token_ids": completion.token_ids,
                          "finish_reason": completion.finish_reason}, ensure_ascii=False))
    stats = llm.engine.stats
    print(f"# {len(outputs)} requests, {stats['generation_tokens']} tokens generated in {stats['steps']} steps; "
          f"KV cache holds {llm.engine.kv_cache_tokens} tokens; {llm.engine.num_compiled_buckets} buckets "
          f"compiled in {llm.engine.startup_seconds:.1f}s", file=sys.stderr)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from jengine.loader import convert_to_orbax

    out = convert_to_orbax(args.model, args.out_dir, dtype=None if args.dtype == "auto" else args.dtype,
                           load_format=args.load_format)
    print(f"wrote an Orbax checkpoint to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jengine", description="LLM serving on JAX/XLA (vLLM-compatible)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts and print them as JSON lines")
    gen.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                     help=f"HF model directory, Orbax directory or preset (default {DEFAULT_MODEL})")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen)
    add_multihost_args(gen)
    gen.set_defaults(func=_generate)

    conv = sub.add_parser("convert", help="write a model's weights as an Orbax checkpoint")
    conv.add_argument("model", help="HF model directory (safetensors) or preset")
    conv.add_argument("out_dir")
    conv.add_argument("--dtype", default="auto")
    conv.add_argument("--load-format", default="auto")
    conv.set_defaults(func=_convert)

    try:
        from jengine.entrypoints.serve import add_serve_parser
    except ImportError:
        add_serve_parser = None
    if add_serve_parser is not None:
        add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"jengine: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
