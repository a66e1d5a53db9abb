"""Logprobs on the host: vLLM's `Logprob`, the flat per-position store the engine keeps them in, and the
vectorised step that turns a step's device results into entries.

A position's logprobs are vLLM's: the chosen token with its rank over the whole vocabulary, then the
top k by rank 1..k (a chosen token among them takes its place there as its rank). As dicts that is one
dict plus k + 1 `Logprob` objects per position, all tracked by Python's garbage collector: a 256-request
run with 5 logprobs spent half of what logprobs add to the host's update in the collector
(benchmarks/RESULTS.md, session 27). `FlatLogprobs` holds the same entries in a few flat lists of
numbers instead; `SamplingParams(flat_logprobs=True)` hands it out as is, otherwise outputs carry
`list[dict[int, Logprob]]`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class FlatLogprobs(Sequence):
    """A sequence of positions, each read as `{token id: Logprob}` (or None for a position without
    entries, such as the first prompt token), stored as flat lists: entries `starts[i]:starts[i + 1]`
    of `token_ids`, `logprobs` and `ranks` belong to position i. `decoded_tokens` is a list beside them
    once any entry has a decoded token (the engine never sets one), None until then."""

    __slots__ = ("starts", "token_ids", "logprobs", "ranks", "decoded_tokens")

    def __init__(self, entries: Iterable[dict[int, Logprob] | None] = ()):
        self.starts: list[int] = [0]
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.ranks: list[int | None] = []
        self.decoded_tokens: list[str | None] | None = None
        self.extend(entries)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            first, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError(f"FlatLogprobs slices take step 1, got {step}")
            out = FlatLogprobs()
            self._copy_into(out, first, max(first, stop))
            return out
        i = index + len(self) if index < 0 else index
        if not 0 <= i < len(self):
            raise IndexError(f"position {index} out of range for {len(self)} positions")
        return self._entry(self.starts[i], self.starts[i + 1])

    def __iter__(self):
        starts = self.starts
        for i in range(len(starts) - 1):
            yield self._entry(starts[i], starts[i + 1])

    def dicts(self, first: int = 0) -> list[dict[int, Logprob] | None]:
        """Positions `first:` as a list of dicts (what outputs carry without flat_logprobs)."""
        starts = self.starts
        return [self._entry(starts[i], starts[i + 1]) for i in range(first, len(starts) - 1)]

    def position(self, i: int) -> tuple[list[int], list[float], list[int | None]]:
        """Position i's entries as lists (token ids, logprobs, ranks), without building a dict; empty
        lists for a position without entries."""
        a, b = self.starts[i], self.starts[i + 1]
        return self.token_ids[a:b], self.logprobs[a:b], self.ranks[a:b]

    def _entry(self, a: int, b: int) -> dict[int, Logprob] | None:
        if a == b:
            return None
        ids, lps, ranks, dec = self.token_ids, self.logprobs, self.ranks, self.decoded_tokens
        if dec is None:
            return {ids[j]: Logprob(lps[j], ranks[j]) for j in range(a, b)}
        return {ids[j]: Logprob(lps[j], ranks[j], dec[j]) for j in range(a, b)}

    def __eq__(self, other) -> bool:
        if isinstance(other, FlatLogprobs | list | tuple):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"FlatLogprobs({list(self)!r})"

    def _decoded(self) -> list[str | None]:
        if self.decoded_tokens is None:
            self.decoded_tokens = [None] * len(self.token_ids)
        return self.decoded_tokens

    def _copy_into(self, out: FlatLogprobs, first: int, stop: int) -> None:
        a, b = self.starts[first], self.starts[stop]
        if self.decoded_tokens is not None or out.decoded_tokens is not None:
            out._decoded().extend(self._decoded()[a:b])
        base = out.starts[-1] - a
        starts = self.starts[first + 1:stop + 1]
        out.starts += starts if base == 0 else [s + base for s in starts]
        out.token_ids += self.token_ids[a:b]
        out.logprobs += self.logprobs[a:b]
        out.ranks += self.ranks[a:b]

    def append(self, entry: dict[int, Logprob] | None) -> None:
        """Add a position from its dict (None: a position without entries)."""
        for token, lp in (entry or {}).items():
            if lp.decoded_token is not None or self.decoded_tokens is not None:
                self._decoded().append(lp.decoded_token)
            self.token_ids.append(token)
            self.logprobs.append(lp.logprob)
            self.ranks.append(lp.rank)
        self.starts.append(len(self.token_ids))

    def extend(self, entries: Iterable[dict[int, Logprob] | None]) -> None:
        if isinstance(entries, FlatLogprobs):
            entries._copy_into(self, 0, len(entries))
            return
        for entry in entries:
            self.append(entry)

    def append_position(self, token_ids: list[int], logprobs: list[float], ranks: list[int]) -> None:
        """Add a position from its entries' lists (no decoded tokens)."""
        if self.decoded_tokens is not None:
            self.decoded_tokens += [None] * len(token_ids)
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.ranks += ranks
        self.starts.append(len(self.token_ids))


@dataclasses.dataclass
class StepEntries:
    """Positions' logprob entries as flat lists: position i's are `[offsets[i]:offsets[i + 1]]`."""

    offsets: list[int]
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]

    def add_to(self, into: FlatLogprobs, i: int) -> None:
        a, b = self.offsets[i], self.offsets[i + 1]
        into.append_position(self.token_ids[a:b], self.logprobs[a:b], self.ranks[a:b])


def step_entries(chosen, chosen_logprobs, chosen_ranks, top_ids, top_logprobs, ks) -> StepEntries:
    """The entries of R positions at once: the chosen token ([R] ids, logprobs, ranks over the whole
    vocabulary), then each position's top `ks[i]` of `top_ids` / `top_logprobs` ([R, N], best first;
    id < 0 marks padding). One numpy pass for the step instead of a Python loop per entry."""
    chosen = np.asarray(chosen, np.int64).reshape(-1)
    ks = np.asarray(ks, np.int64).reshape(-1)
    r = chosen.shape[0]
    k = int(ks.max(initial=0))
    ids = np.asarray(top_ids)[:, :k].astype(np.int64)  # [R, k]
    places = np.arange(1, k + 1)
    listed = (places <= ks[:, None]) & (ids >= 0)  # [R, k]
    is_chosen = listed & (ids == chosen[:, None])
    # A chosen token among the top k takes its place there as its rank (vLLM's convention).
    place = is_chosen.argmax(axis=1) + 1 if k else np.zeros(r, np.int64)
    rank = np.where(is_chosen.any(axis=1), place, np.asarray(chosen_ranks).reshape(-1))
    keep = np.concatenate([np.ones((r, 1), bool), listed & ~is_chosen], axis=1)  # [R, k + 1]
    all_ids = np.concatenate([chosen[:, None], ids], axis=1)
    all_lps = np.concatenate([np.asarray(chosen_logprobs, np.float32).reshape(-1, 1),
                              np.asarray(top_logprobs, np.float32)[:, :k]], axis=1)
    all_ranks = np.concatenate([rank[:, None], np.broadcast_to(places, (r, k))], axis=1)
    offsets = np.zeros(r + 1, np.int64)
    np.cumsum(keep.sum(axis=1), out=offsets[1:])
    return StepEntries(offsets.tolist(), all_ids[keep].tolist(), all_lps[keep].tolist(), all_ranks[keep].tolist())


def append_positions(into: list[FlatLogprobs], chosen, ks, rows, logprobs, ranks, top_ids, top_logprobs) -> None:
    """Add one position to each of `into` (one store may come several times: its positions, in order),
    position j from row `rows[j]` of a step's results: `logprobs`, `ranks` [R] of the chosen tokens and
    the top ids / logprobs [R, N]; `chosen[j]` is the token and `ks[j]` how many top entries it keeps."""
    entries = step_entries(chosen, logprobs[rows], ranks[rows], top_ids[rows], top_logprobs[rows], ks)
    for j, flat in enumerate(into):
        entries.add_to(flat, j)


def for_output(flat: FlatLogprobs, first: int, *, as_flat: bool, built: list | None = None):
    """Positions `first:` as an output carries them: a FlatLogprobs, or vLLM's list of dicts. `built`
    (CUMULATIVE outputs, which repeat every position) holds the dicts made for earlier outputs and is
    extended, so each position's dict is made once; without it the dicts are made and not kept."""
    if as_flat:
        return flat[first:]
    if built is None:
        return flat.dicts(first)
    built += flat.dicts(len(built))
    return built[first:]

