"""The Hugging Face transformers anchor: a random-weight model of the preset's shape, bf16, on CUDA.

torch and transformers are imported lazily (they are on the GPU machine, not in the CPU test venv).
Outputs are forced to full length: EOS is disabled and `min_new_tokens = max_new_tokens`.
"""

from __future__ import annotations

import time

from common import model_shape


def available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _require():
    try:
        import torch
        import transformers
    except ImportError as e:
        raise SystemExit(f"--backend hf needs torch and transformers installed ({e})") from None
    return torch, transformers


def load(model: str, dtype: str = "bfloat16", attn: str = "sdpa"):
    """A random-weight causal LM with the preset's config.json, initialised directly on the GPU."""
    torch, transformers = _require()
    cfg = {k: v for k, v in model_shape(model)["config"].items() if not k.startswith("jengine_")}
    config = transformers.AutoConfig.for_model(**cfg)
    torch_dtype = getattr(torch, dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation=attn)
    model.eval()
    print(f"hf: {type(model).__name__} on {device}, {dtype}, attention {attn}, "
          f"built in {time.perf_counter() - t0:.1f}s "
          f"(transformers {transformers.__version__}, torch {torch.__version__})")
    return model


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def generate_static(model, prompts: list[list[int]], output_lens, batch_size: int) -> tuple[float, int]:
    """Plain `generate` on static batches of `batch_size` (left-padded); (seconds, useful output tokens).

    `output_lens`: one length for all, or one per prompt (a batch then runs to its longest; only the
    tokens each request asked for are counted).
    """
    torch, _ = _require()
    lens = [output_lens] * len(prompts) if isinstance(output_lens, int) else list(output_lens)
    device = next(model.parameters()).device
    out_tokens = 0
    _sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for lo in range(0, len(prompts), batch_size):
            chunk, want = prompts[lo:lo + batch_size], lens[lo:lo + batch_size]
            width, n = max(len(p) for p in chunk), max(want)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            out_tokens += sum(min(w, out.shape[1] - width) for w in want)
    _sync()
    return time.perf_counter() - t0, out_tokens


def generate_batch(model, prompts: list[list[int]], output_lens: list[int], attn: str = "paged|sdpa"):
    """transformers' continuous batching; (seconds, output tokens), or None where this transformers lacks it.

    Equal output lengths go through `generate_batch`; different ones through the manager it wraps, one
    `add_request(max_new_tokens=...)` per request. EOS is disabled (eos_token_id -1).
    """
    torch, transformers = _require()
    if not hasattr(model, "generate_batch"):
        print(f"hf: transformers {transformers.__version__} has no generate_batch; skipped")
        return None
    from transformers import GenerationConfig

    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation(attn)
    except (ValueError, ImportError) as e:
        print(f"hf: could not switch attention to {attn!r} ({e}); generate_batch picks its own")
    config = GenerationConfig(max_new_tokens=max(output_lens), do_sample=False, eos_token_id=-1, pad_token_id=0)
    try:
        model.generate_batch(inputs=prompts[:4], generation_config=config, progress_bar=False)  # warm-up
        _sync()
        t0 = time.perf_counter()
        if len(set(output_lens)) == 1:
            results = list(model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False).values())
        else:
            results = _manager_run(model, config, prompts, output_lens)
        _sync()
        elapsed = time.perf_counter() - t0
    finally:
        model.set_attn_implementation(previous)
    return elapsed, sum(len(r.generated_tokens) for r in results)


def _manager_run(model, config, prompts: list[list[int]], output_lens: list[int]) -> list:
    import torch

    results = []
    with torch.inference_mode(), model.continuous_batching_context_manager(generation_config=config, block=True,
                                                                           timeout=5) as manager:
        for i, (p, n) in enumerate(zip(prompts, output_lens)):
            manager.add_request(input_ids=p, request_id=f"req_{i}", max_new_tokens=n, eos_token_id=-1)
        while len(results) < len(prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results.append(result)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped early")
    return results
