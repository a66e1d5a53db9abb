"""How many tokens a request of the OpenAI server may generate: vLLM's server rule.

The smallest of: what the request asks for (else the generation config's default `max_new_tokens`), the
room its prompt leaves in `max_model_len`, and the server-wide ceiling an operator sets with
`--generation-config DIR` (that directory's `max_new_tokens`) or `--override-generation-config
'{"max_new_tokens": N}'`. A model directory's own file ("auto") gives only a default, never a ceiling.
Asking for more than the context can hold is an error, as in vLLM (and OpenAI); leaving it unset is not.

Host side, plain Python (no jax).
"""

from __future__ import annotations


def generation_ceiling(setting: str, sampling_defaults: dict, override: dict | None) -> int | None:
    """The server-wide cap on max_tokens: `setting` is EngineConfig.generation_config ("auto", "vllm" or a
    directory), `sampling_defaults` the engine's merged defaults, `override` the operator's overrides."""
    if setting not in ("auto", "vllm"):
        return sampling_defaults.get("max_tokens")
    return (override or {}).get("max_new_tokens")


def max_tokens_for(prompt_len: int, requested: int | None, *, max_model_len: int, default: int | None = None,
                   ceiling: int | None = None, param: str = "max_tokens") -> int:
    """A prompt's max_tokens: `requested` (the request's value, None when unset; `param` names it in
    errors), else `default`, capped by the room the prompt leaves and by `ceiling`."""
    room = max_model_len - prompt_len
    if room < 1:
        raise ValueError(f"prompt of {prompt_len} tokens leaves no room to generate: max_model_len is "
                         f"{max_model_len}; shorten the prompt (or set truncate_prompt_tokens)")
    if requested is not None and requested > room:
        raise ValueError(f"{param}={requested} plus the prompt's {prompt_len} tokens is {prompt_len + requested}, "
                         f"more than max_model_len={max_model_len}; ask for at most {room} tokens")
    wanted = requested if requested is not None else default
    return min(v for v in (room, wanted, ceiling) if v is not None)
