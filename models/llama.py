"""The Llama family (Llama 2/3/3.x, Mistral, Qwen2, Qwen3) as pure functions of a params pytree.

Params are a flat dict of arrays keyed by jengine names (`layers.3.qkv`). Every weight is declared
once in `weight_specs` with its shape, logical axes and the Hugging Face tensors it comes from;
random init, loading and sharding are all derived from that declaration.

Q/K/V and gate/up are fused into one matmul each at load time (one weight read instead of three or two).
Under tensor parallelism (`mesh`) the fused columns are in the shard-major layout of
`jengine.sharding`, so the fused outputs are split per shard (`[T, tp, per_shard]`); tp = 1 is the
checkpoint's order. Attention and the cache write run per KV-head shard.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jengine.config import ModelConfig
from jengine.kernels_pallas import swiglu_matmul
from jengine.kernels_pallas.ragged_paged_attention import (
    attention_q_dtype,
    is_fp8,
    ragged_paged_attention,
    rope_and_write_kv,
)
from jengine.models.common import (
    KV_CACHE_SCALES,
    ModelInput,
    WeightSpec,
    linear,
    rms_norm,
    rope_inv_freq,
)
from jengine.sharding import per_head_shard, tp_size


def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """Every parameter of the model, in jengine's names, with shape, logical axes and HF sources."""
    h, d, inter, vocab = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    q_out, kv_out = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def linear(axes, *sources):  # HF Linear weights: [out, in] each, fused along out
        out = sum(shape[0] for _, shape in sources)
        return WeightSpec((sources[0][1][1], out), axes, sources)

    def vector(size, axes, name, init="ones"):
        return WeightSpec((size,), axes, ((name, (size,)),), transpose=False, init=init)

    specs = {
        "embed": WeightSpec((vocab, h), ("vocab", "embed"), (("model.embed_tokens.weight", (vocab, h)),),
                            transpose=False),
        "final_norm": vector(h, ("embed",), "model.norm.weight"),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = linear(("embed", "vocab"), ("lm_head.weight", (vocab, h)))
    for i in range(cfg.num_hidden_layers):
        hf = f"model.layers.{i}."
        att = hf + "self_attn."
        qkv_sizes = {"q": q_out, "k": kv_out, "v": kv_out}
        layer = {
            "input_norm": vector(h, ("embed",), hf + "input_layernorm.weight"),
            "qkv": linear(("embed", "qkv"), *((att + f"{p}_proj.weight", (n, h)) for p, n in qkv_sizes.items())),
            "o": linear(("heads", "embed"), (att + "o_proj.weight", (h, q_out))),
            "post_norm": vector(h, ("embed",), hf + "post_attention_layernorm.weight"),
            "gate_up": linear(("embed", "mlp"), (hf + "mlp.gate_proj.weight", (inter, h)),
                              (hf + "mlp.up_proj.weight", (inter, h))),
            "down": linear(("mlp", "embed"), (hf + "mlp.down_proj.weight", (h, inter))),
        }
        if cfg.attention_bias:
            layer["qkv_bias"] = WeightSpec(
                (q_out + 2 * kv_out,), ("qkv",),
                tuple((att + f"{p}_proj.bias", (n,)) for p, n in qkv_sizes.items()), transpose=False,
                init="zeros")
        if cfg.qk_norm:
            layer["q_norm"] = vector(d, (None,), att + "q_norm.weight")
            layer["k_norm"] = vector(d, (None,), att + "k_norm.weight")
        specs.update({f"layers.{i}.{name}": spec for name, spec in layer.items()})
    return specs


def _attention(params, cfg, x, inp: ModelInput, kv_cache, cos, sin, mesh):
    num_tokens, tp = x.shape[0], tp_size(mesh)
    hq, d = cfg.num_attention_heads, cfg.head_dim
    qkv = linear(x, params, "qkv")  # [T, (Hq + 2 Hkv) D]
    if cfg.attention_bias:
        qkv = qkv + params["qkv_bias"]
    qkv = qkv.reshape(num_tokens, tp, -1)  # [T, tp, per_shard], each shard's Q, K, V columns in turn
    if cfg.qk_norm:
        qkv = _qk_norm(params, cfg, qkv, tp)
    scales = params.get(KV_CACHE_SCALES) if is_fp8(kv_cache.dtype) else None

    def attend(kv_cache, qkv, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs, cos, sin, *scales):
        # Q in the dtype the attention reads it in (float16 for an 8-bit cache on Hopper), written so by the RoPE
        # kernel rather than converted in a pass of its own; the attention's result in the model's dtype.
        q, kv_cache = rope_and_write_kv(kv_cache, qkv.reshape(num_tokens, -1), cos, sin, slot_mapping,
                                        num_q_heads=hq // tp, kv_scales=scales[0] if scales else None,
                                        q_dtype=attention_q_dtype(qkv.dtype, kv_cache, hq // tp))
        out = ragged_paged_attention(
            q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
            sm_scale=d**-0.5, sliding_window=cfg.sliding_window, out_dtype=qkv.dtype,
        )  # [T, Hq, D]
        return kv_cache, out

    kv_cache, out = per_head_shard(attend, mesh, 2)(
        kv_cache, qkv, inp.slot_mapping, inp.kv_lens, inp.page_indices, inp.cu_q_lens, inp.num_seqs, cos, sin,
        *(() if scales is None else (scales,)))
    if scales is not None:
        out = (out * scales[1]).astype(out.dtype)
    return linear(out.reshape(num_tokens, hq * d), params, "o"), kv_cache


def _qk_norm(params, cfg, qkv, tp):
    """Qwen3's per-head RMSNorm of the queries and keys, before RoPE; `qkv` stays `[T, tp, per_shard]`."""
    num_tokens, d = qkv.shape[0], cfg.head_dim
    hq_s, hkv_s = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp  # heads per shard
    heads = qkv.reshape(num_tokens, tp, hq_s + 2 * hkv_s, d)
    q = rms_norm(heads[:, :, :hq_s], params["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(heads[:, :, hq_s : hq_s + hkv_s], params["k_norm"], cfg.rms_norm_eps)
    return jnp.concatenate([q, k, heads[:, :, hq_s + hkv_s :]], axis=2).reshape(qkv.shape)


def _mlp(params, cfg, x, tp):
    if tp == 1 and swiglu_matmul.use_kernel(x, params["gate_up"]):
        # Hopper, large steps: the product in the gate/up GEMM's epilogue (no [T, 2 I] intermediate)
        return linear(swiglu_matmul.swiglu_matmul(x, params["gate_up"]), params, "down")
    inter = cfg.intermediate_size // tp
    gate_up = linear(x, params, "gate_up").reshape(x.shape[0], tp, 2 * inter)  # [T, tp, 2 I / tp]
    gate = gate_up[:, :, :inter].reshape(x.shape[0], cfg.intermediate_size)
    up = gate_up[:, :, inter:].reshape(x.shape[0], cfg.intermediate_size)
    return linear(jax.nn.silu(gate) * up, params, "down")


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"))
def _layer(params: dict, x: jax.Array, inp: ModelInput, kv_cache, cos, sin, *, cfg: ModelConfig, mesh):
    """One decoder layer. Jitted on its own so that a step traces and lowers it (and its attention
    kernel) once, not once per layer: the layers share shapes, so their calls share one function;
    XLA inlines it again, so the compiled program is the same."""
    attn, kv_cache = _attention(params, cfg, rms_norm(x, params["input_norm"], cfg.rms_norm_eps), inp, kv_cache,
                                cos, sin, mesh)
    x = x + attn
    x = x + _mlp(params, cfg, rms_norm(x, params["post_norm"], cfg.rms_norm_eps), tp_size(mesh))
    return x, kv_cache


def forward(params: dict, cfg: ModelConfig, inp: ModelInput, kv_caches: list,
            mesh=None) -> tuple[list, jax.Array]:
    """Run the decoder over a ragged batch of tokens (`mesh`: the tensor-parallel mesh, None for one device).

    Returns the updated per-layer KV caches and the final-normed hidden states `[T, H]`.
    """
    x = params["embed"][inp.token_ids]  # [T, H]
    cos, sin = _rope_tables(cfg, inp.positions)
    new_caches = []
    for i in range(cfg.num_hidden_layers):
        prefix = f"layers.{i}."
        layer_params = {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}
        x, cache = _layer(layer_params, x, inp, kv_caches[i], cos, sin, cfg=cfg, mesh=mesh)
        new_caches.append(cache)
    return new_caches, rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def compute_logits(params: dict, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Project final hidden states `[N, H]` to f32 logits `[N, V]`."""
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.dot(hidden, head, preferred_element_type=jnp.float32)


def _rope_tables(cfg: ModelConfig, positions: jax.Array):
    inv_freq, scale = rope_inv_freq(cfg.rope, cfg.head_dim)
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale
