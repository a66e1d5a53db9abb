"""One engine step as the host prepares it: `StepInput`, padded to a (T, S) bucket, built from the
scheduled rows (`build_step_input`), and packed into one int32 and one float32 buffer plus a hashable
layout for the transfer (`pack`), which the device programs take apart again (`unpack`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jengine.models import ModelInput
from jengine.request import PLACEHOLDER
from jengine.sampling_tables import SamplingTensors


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInput:
    """Everything one step needs, padded to a (T, S) bucket; the only object crossing to the device."""

    model: ModelInput
    logits_indices: jax.Array  # [S] int32, index in T of each sequence's last scheduled token
    prev_token_index: jax.Array  # [T] int32, row of the previous step's output to take the token from; -1: known
    prompt_targets: jax.Array  # [T] int32, next prompt token whose logprob is wanted at each position; -1: none
    sampling: SamplingTensors | None  # None in the part packed for the forward program


def pack(inp: StepInput) -> tuple[np.ndarray, np.ndarray, tuple]:
    """Flatten a numpy StepInput into one int32 and one float32 buffer plus a hashable layout.

    Two transfers per step instead of ~25: on the H200 (benchmarks/dispatch.py) a jitted call with
    30 numpy arguments blocked until the previous computation finished, one with 2 did not. (The
    engine's step launch still blocks for another reason; see benchmarks/RESULTS.md.)
    """
    leaves, treedef = jax.tree_util.tree_flatten(inp)
    ints, floats, spec = [], [], []
    for leaf in leaves:
        a = np.asarray(leaf)
        if a.dtype == np.float32:
            floats.append(a.ravel())
        elif a.dtype == np.uint32:
            ints.append(a.ravel().view(np.int32))
        else:
            ints.append(a.ravel().astype(np.int32, copy=False))
        spec.append((a.shape, a.dtype.str))
    as_buffer = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(1, dtype)  # noqa: E731
    return as_buffer(ints, np.int32), as_buffer(floats, np.float32), (treedef, tuple(spec))


def unpack(ints: jax.Array, floats: jax.Array, layout: tuple) -> StepInput:
    """Inverse of `pack`, inside the jitted step (static slices, so free)."""
    treedef, spec = layout
    leaves, io, fo = [], 0, 0
    for shape, dtype_str in spec:
        dtype, size = np.dtype(dtype_str), int(np.prod(shape, dtype=np.int64))
        if dtype == np.float32:
            leaf, fo = floats[fo : fo + size], fo + size
        else:
            leaf, io = ints[io : io + size], io + size
            if dtype == np.uint32:
                leaf = jax.lax.bitcast_convert_type(leaf, jnp.uint32)
            elif dtype == np.bool_:
                leaf = leaf != 0
        leaves.append(leaf.reshape(shape))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def build_step_input(rows, num_tokens_padded: int, num_seqs_padded: int, pages_per_seq: int,
                     block_size: int, sampling: SamplingTensors) -> StepInput:
    """Numpy StepInput from scheduled rows `(token_ids, start_position, block_table, prev_row, targets)`;
    `targets` are the prompt tokens whose logprobs are wanted after each of the row's tokens (or None).

    Token ids equal to PLACEHOLDER are filled on the device from row `prev_row` of the previous
    step's output. Padding tokens write nowhere (slot -1); padding rows have no queries and no keys.
    """
    T, S = num_tokens_padded, num_seqs_padded
    n = len(rows)
    lens = np.fromiter((len(r[0]) for r in rows), np.int32, n)
    starts = np.fromiter((r[1] for r in rows), np.int32, n)
    cu_q_lens = np.zeros(S + 1, np.int32)
    np.cumsum(lens, out=cu_q_lens[1 : n + 1])
    total = int(cu_q_lens[n])
    cu_q_lens[n + 1 :] = total
    kv_lens = np.zeros(S, np.int32)
    kv_lens[:n] = starts + lens
    page_indices = np.zeros((S, pages_per_seq), np.int32)
    for i, r in enumerate(rows):
        page_indices[i, : len(r[2])] = r[2]
    logits_indices = np.zeros(S, np.int32)
    logits_indices[:n] = cu_q_lens[1 : n + 1] - 1
    # Per token: its row, its position, its page slot (vectorised over the whole batch).
    row_of = np.repeat(np.arange(n, dtype=np.int32), lens)
    pos = np.repeat(starts, lens) + np.arange(total, dtype=np.int32) - np.repeat(cu_q_lens[:n], lens)
    ids = np.fromiter((t for r in rows for t in r[0]), np.int32, total)
    unknown = ids == PLACEHOLDER
    prev_rows = np.fromiter((r[3] for r in rows), np.int32, n)
    assert not np.any(unknown & (prev_rows[row_of] < 0)), "a placeholder token without the step that samples it"
    token_ids = np.zeros(T, np.int32)
    token_ids[:total] = np.where(unknown, 0, ids)
    prev_index = np.full(T, -1, np.int32)
    prev_index[:total] = np.where(unknown, prev_rows[row_of], -1)
    positions = np.zeros(T, np.int32)
    positions[:total] = pos
    slots = np.full(T, -1, np.int32)
    slots[:total] = page_indices[row_of, pos // block_size] * block_size + pos % block_size
    prompt_targets = np.full(T, -1, np.int32)
    for i, r in enumerate(rows):
        if r[4] is not None:
            prompt_targets[cu_q_lens[i] : cu_q_lens[i] + len(r[4])] = r[4]
    model = ModelInput(token_ids=token_ids, positions=positions, slot_mapping=slots, cu_q_lens=cu_q_lens,
                       kv_lens=kv_lens, page_indices=page_indices, num_seqs=np.array([len(rows)], np.int32))
    return StepInput(model=model, logits_indices=logits_indices, prev_token_index=prev_index,
                     prompt_targets=prompt_targets, sampling=sampling)
