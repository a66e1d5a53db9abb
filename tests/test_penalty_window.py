"""The penalty window kept across steps gives the (id, count) pairs that counting from the token lists gives."""

import random

import numpy as np

from jengine.penalty_window import PenaltyWindow, count_penalty_window


def _pairs(ids, counts):
    return sorted(zip(np.asarray(ids).tolist(), np.asarray(counts).tolist()))


def test_kept_window_matches_counting_step_by_step():
    rng = random.Random(0)
    V, W = 50, 40
    for trial in range(200):
        prompt = [rng.randrange(-1, V + 3) for _ in range(rng.randrange(0, 30))]
        window = PenaltyWindow(prompt, V, W)
        output = []
        for _ in range(rng.randrange(1, 40)):
            output.append(rng.randrange(V + 3))  # ids past V are skipped by both
            got = window.rows(prompt, output, V, W)
            assert _pairs(*got) == _pairs(*count_penalty_window(prompt, output, V, W)), (trial, prompt, output)


def test_placeholders_wait_until_their_token_is_known():
    window = PenaltyWindow([1, 2], 10, 8)
    assert _pairs(*window.rows([1, 2], [3, -1], 10, 8)) == [(1, 0), (2, 0), (3, 1)]
    assert _pairs(*window.rows([1, 2], [3, 3], 10, 8)) == [(1, 0), (2, 0), (3, 2)]  # the placeholder resolved


def test_a_window_that_would_overflow_goes_back_to_counting():
    prompt, V, W = [0, 1, 2], 20, 4
    window = PenaltyWindow(prompt, V, W)
    assert _pairs(*window.rows(prompt, [5], V, W)) == [(0, 0), (1, 0), (2, 0), (5, 1)]
    output = [5, 6, 6]  # five unique ids for four slots: the output's come first, by count
    ids, counts = window.rows(prompt, output, V, W)
    assert window.exact and ids.tolist() == [6, 5, 0, 1] and counts.tolist() == [2, 1, 0, 0]
    assert PenaltyWindow(list(range(10)), V, W).exact  # the prompt alone overflows
