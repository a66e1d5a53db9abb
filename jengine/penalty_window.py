"""A request's penalty window on the host: the unique token ids of its prompt and output, with their output
counts, as the sampler's `[S, W]` penalty table rows take them (host side, numpy; no jax).

`count_penalty_window` counts them from the token lists. `PenaltyWindow` keeps one request's window across steps
and folds in only the tokens added since the last step: recounting 256 rows of 512-768 tokens took ~28 ms a
step on an H200's host, longer than the 10.5 ms decode step it prepares (RESULTS.md, session 35). While a
window holds every unique id (at most W) the two give the same (id, count) pairs, which is all the sampler
reads; one that would overflow W goes back to counting, which decides what to keep.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def count_penalty_window(prompt_ids: Sequence[int], output_ids: Sequence[int], V: int, W: int):
    """Unique ids of prompt+output (output first, by count) with their output counts, at most W."""
    out = np.asarray(output_ids, np.int64)
    out_ids, out_counts = np.unique(out[(out >= 0) & (out < V)], return_counts=True)
    order = np.argsort(-out_counts, kind="stable")
    out_ids, out_counts = out_ids[order], out_counts[order]
    prompt = np.asarray(prompt_ids, np.int64)
    prompt_only = np.setdiff1d(prompt[(prompt >= 0) & (prompt < V)], out_ids)
    ids = np.concatenate([out_ids, prompt_only])[:W]
    counts = np.concatenate([out_counts, np.zeros(len(prompt_only), np.int64)])[:W]
    return ids, counts


class PenaltyWindow:
    """One request's penalty window, updated step by step. `rows(prompt, output, V, W)` returns what
    `count_penalty_window` would (as a set of (id, count) pairs), folding in the output tokens it has not seen.
    Output tokens are folded up to the first negative one (a placeholder for a token still on the device)."""

    def __init__(self, prompt_ids: Sequence[int], vocab_size: int, window: int):
        self.vocab_size, self.window = vocab_size, window
        prompt = np.asarray(prompt_ids, np.int64)
        unique = np.unique(prompt[(prompt >= 0) & (prompt < vocab_size)])
        self.exact = len(unique) > window  # the prompt alone overflows: count every step
        self.ids = np.zeros(window, np.int32)
        self.counts = np.zeros(window, np.int32)
        self.size = 0 if self.exact else len(unique)
        self.ids[: self.size] = unique[: self.size]
        self.index = {int(t): i for i, t in enumerate(unique)} if not self.exact else {}
        self.folded = 0  # output tokens counted so far

    def rows(self, prompt_ids: Sequence[int], output_ids: Sequence[int], V: int, W: int):
        if self.exact or V != self.vocab_size or W != self.window:
            return count_penalty_window(prompt_ids, output_ids, V, W)
        index, ids, counts = self.index, self.ids, self.counts
        while self.folded < len(output_ids):
            token = output_ids[self.folded]
            if token < 0:
                break
            self.folded += 1
            if token >= V:
                continue
            at = index.get(token)
            if at is None:
                if self.size == W:  # a new id past the window: counting decides what stays
                    self.exact = True
                    return count_penalty_window(prompt_ids, output_ids, V, W)
                at = index[token] = self.size
                ids[at] = token
                self.size += 1
            counts[at] += 1
        return ids[: self.size], counts[: self.size]
