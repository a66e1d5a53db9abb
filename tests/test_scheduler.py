"""Scheduler: batching, chunked prefill, prefix hits, preemption (recompute and swap), stop rules.

`FakeDevice` plays the runner: it executes the swap and copy lists, writes each scheduled token id
into the slot its page table names, and checks that every earlier position of the request reads
back its own token, so a wrong page table, a missed copy or a bad prefix hit fails loudly.
"""

import copy
import random

import pytest

from jengine.request import Request, RequestStatus
from jengine.sampling_params import SamplingParams
from jengine.scheduler import Scheduler, SchedulerOutput

BS = 4
EOS = 99


def make(**kw):
    cfg = dict(num_blocks=17, block_size=BS, max_num_batched_tokens=64, max_num_seqs=8,
               max_model_len=64, eos_token_ids=(EOS,))
    cfg.update(kw)
    return Scheduler(**cfg)


def req(rid, prompt, max_tokens=4, arrival=None, priority=0, **sp):
    prompt = list(range(10, 10 + prompt)) if isinstance(prompt, int) else list(prompt)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=sp.pop("ignore_eos", True), **sp)
    return Request(rid, prompt, params, arrival_time=arrival if arrival is not None else 0.0,
                   priority=priority)


def next_token(request, position):
    """A deterministic 'model': the token after `position` depends only on the request and position."""
    return 1000 + (sum(map(ord, request.request_id)) % 7) * 100 + position


class FakeDevice:
    def __init__(self, sched):
        bm = sched.block_manager
        self.pages = {b: [None] * BS for b in range(bm.num_blocks)}
        self.host = {c: [None] * BS for c in range(bm.num_cpu_blocks)}

    def run(self, out):
        for dev, cpu in out.blocks_to_swap_out:
            self.host[cpu] = list(self.pages[dev])
        for cpu, dev in out.blocks_to_swap_in:
            self.pages[dev] = list(self.host[cpu])
        for src, dst in out.blocks_to_copy:
            self.pages[dst] = list(self.pages[src])
        for s in out.scheduled:  # like rope_and_write_kv: the whole batch's K/V lands before attention reads
            assert 0 not in s.block_table, "null page handed to a request"
            for k, tok in enumerate(s.token_ids):
                p = s.start_position + k
                self.pages[s.block_table[p // BS]][p % BS] = tok
        sampled = []
        for s in out.scheduled:
            table, tokens = s.block_table, s.request.all_token_ids
            end = s.start_position + s.num_new_tokens
            for p in range(end):
                assert self.pages[table[p // BS]][p % BS] == tokens[p], (s.request_id, p)
            sampled.append(next_token(s.request, end - 1))
        return sampled


def step(sched, tokens=None):
    out = sched.schedule()
    ids = tokens if tokens is not None else [next_token(s.request, s.start_position + s.num_new_tokens - 1)
                                             for s in out.scheduled]
    return out, sched.update(out, ids)


def plan(out):
    return [(s.request_id, s.start_position, s.num_new_tokens, s.produces_token) for s in out.scheduled]


def assert_no_leaks(sched):
    bm = sched.block_manager
    bm.check_invariants()
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks


def test_prompt_runs_whole_then_one_token_per_step_until_max_tokens():
    sched = make()
    a = req("a", 10, max_tokens=3)
    sched.add_request(a)
    out, done = step(sched, [5])
    assert plan(out) == [("a", 0, 10, True)]
    assert out.num_scheduled_tokens == 10 and out.scheduled[0].block_table == [1, 2, 3]
    assert a.output_token_ids == [5] and a.num_computed_tokens == 10 and not done
    out, done = step(sched, [6])
    assert plan(out) == [("a", 10, 1, True)]
    assert out.scheduled[0].token_ids == [5]
    out, done = step(sched, [7])
    assert done == [a] and a.status == RequestStatus.FINISHED_LENGTH and a.finish_reason == "length"
    assert a.output_token_ids == [5, 6, 7]
    assert a.metrics.first_token_time is not None and a.metrics.finished_time is not None
    assert_no_leaks(sched)


def test_unlimited_max_tokens_stops_at_max_model_len():
    sched = make(max_model_len=16)
    r = req("r", 10, max_tokens=None)
    sched.add_request(r)
    while sched.has_unfinished():
        step(sched)
    assert r.num_tokens == 16 and r.num_output_tokens == 6 and r.finish_reason == "length"
    assert_no_leaks(sched)


def test_chunked_prefill_splits_prompt_under_tiny_budget():
    sched = make(max_num_batched_tokens=4)
    sched.add_request(req("a", 10, max_tokens=1))
    plans = [plan(step(sched, [1])[0]) for _ in range(3)]
    assert plans == [[("a", 0, 4, False)], [("a", 4, 4, False)], [("a", 8, 2, True)]]
    assert_no_leaks(sched)


def test_decodes_are_scheduled_before_waiting_prefills_in_the_same_step():
    sched = make(max_num_batched_tokens=8)
    sched.add_request(req("a", 3, max_tokens=5, arrival=0))
    step(sched)
    sched.add_request(req("b", 10, max_tokens=1, arrival=1))
    out, _ = step(sched)
    assert plan(out) == [("a", 3, 1, True), ("b", 0, 7, False)]
    out, _ = step(sched)
    assert plan(out) == [("a", 4, 1, True), ("b", 7, 3, True)]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    sched = make(max_num_batched_tokens=10, enable_chunked_prefill=False)
    sched.add_request(req("a", 3, max_tokens=2, arrival=0))
    step(sched)
    sched.add_request(req("b", 10, max_tokens=1, arrival=1))
    out, done = step(sched)
    assert plan(out) == [("a", 3, 1, True)] and [r.request_id for r in done] == ["a"]
    out, _ = step(sched)
    assert plan(out) == [("b", 0, 10, True)]
    assert_no_leaks(sched)


def test_max_num_seqs_caps_the_batch():
    sched = make(max_num_seqs=2)
    for i in range(3):
        sched.add_request(req(f"r{i}", 2, arrival=i))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 1


def test_prefix_hit_skips_prefill_of_shared_blocks():
    sched = make()
    a = req("a", list(range(10)), max_tokens=1)
    sched.add_request(a)
    step(sched)
    b = req("b", list(range(8)) + [50, 51, 52], max_tokens=1)
    sched.add_request(b)
    out = sched.schedule()
    assert plan(out) == [("b", 8, 3, True)]
    assert b.num_cached_tokens == 8
    assert out.scheduled[0].block_table[:2] == [1, 2]  # a's first two pages, now b's
    sched.update(out, [1])
    assert sched.block_manager.prefix_cache_hits == 8
    assert_no_leaks(sched)


def test_requests_admitted_in_the_same_step_share_prompt_pages():
    sched = make()
    sched.add_request(req("a", 10, max_tokens=1, arrival=0))
    sched.add_request(req("b", 10, max_tokens=1, arrival=1))
    out = sched.schedule()
    assert plan(out) == [("a", 0, 10, True), ("b", 8, 2, True)]
    assert out.scheduled[1].block_table[:2] == out.scheduled[0].block_table[:2]
    sched.update(out, [1, 2])
    assert_no_leaks(sched)


def test_identical_prompt_still_computes_its_last_token():
    sched = make()
    sched.add_request(req("a", 8, max_tokens=1))
    step(sched)
    sched.add_request(req("b", 8, max_tokens=1))
    out, _ = step(sched)
    assert plan(out) == [("b", 4, 4, True)]  # last page recomputed so logits exist


def two_requests_on_a_full_pool(**kw):
    """Pool of 4 pages; a and b take 2 each; a's third page must come from preempting b."""
    sched = make(num_blocks=5, enable_prefix_caching=False, **kw)
    a, b = req("a", 7, max_tokens=8, arrival=0), req("b", range(30, 37), max_tokens=8, arrival=1)
    sched.add_request(a)
    sched.add_request(b)
    assert plan(step(sched)[0]) == [("a", 0, 7, True), ("b", 0, 7, True)]
    assert plan(step(sched)[0]) == [("a", 7, 1, True), ("b", 7, 1, True)]
    return sched, a, b


def test_preemption_by_recompute_evicts_latest_request_and_recomputes_it_after():
    sched, a, b = two_requests_on_a_full_pool()
    out, _ = step(sched)
    assert plan(out) == [("a", 8, 1, True)] and out.preempted == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.stats()["num_preemptions"] == 1 and sched.stats()["num_requests_waiting"] == 1
    assert sched.stats()["kv_cache_usage_perc"] == 0.75
    assert b.output_token_ids == [next_token(b, 6), next_token(b, 7)]  # kept for the recompute
    while a.status == RequestStatus.RUNNING:
        out, _ = step(sched)
        assert [s.request_id for s in out.scheduled] == ["a"]  # a now needs every page
    out, _ = step(sched)
    assert plan(out) == [("b", 0, 9, True)]  # prompt and both outputs, in one chunk
    while sched.has_unfinished():
        step(sched)
    assert b.output_token_ids == [next_token(b, p) for p in range(6, 14)]
    assert_no_leaks(sched)


def test_preemption_by_swap_resumes_decoding_without_recompute():
    sched, a, b = two_requests_on_a_full_pool(preemption_mode="swap", num_cpu_blocks=4)
    out, _ = step(sched)
    assert out.preempted == ["b"] and out.blocks_to_swap_out == [(3, 0), (4, 1)]
    assert b.status == RequestStatus.SWAPPED and b.num_computed_tokens == 8 and sched.num_swapped == 1
    while a.status == RequestStatus.RUNNING:
        out, _ = step(sched)
        assert out.blocks_to_swap_in == []
    out, _ = step(sched)
    assert plan(out) == [("b", 8, 1, True)]
    assert [cpu for cpu, _ in out.blocks_to_swap_in] == [0, 1]
    assert out.scheduled[0].block_table[:2] == [dev for _, dev in out.blocks_to_swap_in]
    while sched.has_unfinished():
        step(sched)
    assert b.output_token_ids == [next_token(b, p) for p in range(6, 14)]
    assert_no_leaks(sched)


def test_swap_falls_back_to_recompute_when_host_pool_is_full():
    sched, a, b = two_requests_on_a_full_pool(preemption_mode="swap", num_cpu_blocks=1)
    out, _ = step(sched)
    assert out.preempted == ["b"] and out.blocks_to_swap_out == []
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0


def test_preempted_request_is_admitted_before_later_arrivals():
    sched, a, b = two_requests_on_a_full_pool()
    step(sched)  # b preempted
    sched.add_request(req("c", 3, max_tokens=1, arrival=2))  # would fit, but b is older
    out, _ = step(sched)
    assert plan(out) == [("a", 9, 1, True)]
    order = []
    while sched.has_unfinished():
        out, _ = step(sched)
        order += [s.request_id for s in out.scheduled if s.start_position == 0]
    assert order == ["b", "c"]
    assert_no_leaks(sched)


def test_priority_policy_admits_urgent_first_and_preempts_least_urgent():
    sched = make(num_blocks=5, enable_prefix_caching=False, policy="priority")
    low = req("low", 7, max_tokens=8, arrival=0, priority=5)
    high = req("high", range(30, 37), max_tokens=8, arrival=1, priority=0)
    sched.add_request(low)
    sched.add_request(high)
    assert [s.request_id for s in step(sched)[0].scheduled] == ["high", "low"]
    step(sched)
    out, _ = step(sched)
    assert out.preempted == ["low"] and [s.request_id for s in out.scheduled] == ["high"]


def test_eos_stops_unless_ignored_or_before_min_tokens():
    sched = make()
    stop = req("stop", 3, max_tokens=5, ignore_eos=False)
    ignore = req("ignore", 3, max_tokens=5, ignore_eos=True)
    early = req("early", 3, max_tokens=5, ignore_eos=False, min_tokens=2)
    for r in (stop, ignore, early):
        sched.add_request(r)
    _, done = step(sched, [EOS, EOS, EOS])
    assert done == [stop] and stop.finish_reason == "stop" and stop.stop_reason == EOS
    _, done = step(sched, [EOS, EOS])
    assert done == [early] and early.output_token_ids == [EOS, EOS]
    assert ignore.status == RequestStatus.RUNNING


def test_stop_token_ids_stop_with_reason():
    sched = make()
    r = req("r", 3, max_tokens=5, stop_token_ids=[42])
    sched.add_request(r)
    step(sched, [7])
    _, done = step(sched, [42])
    assert done == [r] and r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 42
    assert_no_leaks(sched)


def test_finish_request_and_abort_free_everything():
    sched = make()
    a, b, c = req("a", 5), req("b", 5), req("c", 5)
    for r in (a, b, c):
        sched.add_request(r)
    out = sched.schedule()
    assert sched.finish_request("a", "stop") is a and a.status == RequestStatus.FINISHED_STOPPED
    assert sched.abort("b") is b and b.finish_reason == "abort"
    done = sched.update(out, [1, 2, 3])  # a and b ended while the step ran: ignored
    assert done == [] and a.output_token_ids == [] and c.output_token_ids == [3]
    assert sched.abort("missing") is None
    sched.add_request(req("d", 5))
    sched.abort("d")  # still waiting
    sched.abort("c")
    assert sched.schedule().finished_ids == ["a", "b", "d", "c"]
    assert sched.schedule().finished_ids == []
    assert_no_leaks(sched)


def test_update_accepts_one_id_per_sampling_request():
    sched = make(max_num_batched_tokens=6)
    sched.add_request(req("a", 2, max_tokens=3, arrival=0))
    step(sched)
    sched.add_request(req("b", 10, max_tokens=1, arrival=1))
    out = sched.schedule()
    assert plan(out) == [("a", 2, 1, True), ("b", 0, 5, False)]
    sched.update(out, [77])
    assert sched.get_request("a").output_token_ids[-1] == 77
    with pytest.raises(ValueError, match="sampled ids"):
        sched.update(sched.schedule(), [])


def test_forked_request_shares_pages_and_copies_the_shared_partial_page():
    sched = make()
    sched.add_request(req("p", 6, max_tokens=4))
    step(sched)
    child = sched.fork_request("p", req("c", 6, max_tokens=4))
    assert child.all_token_ids == sched.get_request("p").all_token_ids
    out, _ = step(sched)
    assert plan(out) == [("p", 6, 1, True), ("c", 6, 1, True)]
    assert out.blocks_to_copy == [(2, 3)]
    assert [s.block_table for s in out.scheduled] == [[1, 3], [1, 2]]
    while sched.has_unfinished():
        step(sched)
    assert_no_leaks(sched)


@pytest.mark.parametrize(("message", "bad", "kw"), [
    ("prompt is empty", req("e", []), {}),
    ("max_model_len=64", req("long", 60, max_tokens=5), {}),
    ("cache holds only 4 blocks", req("big", 14, max_tokens=3), {"num_blocks": 5}),
    ("chunked prefill is disabled", req("wide", 20), {"max_num_batched_tokens": 16,
                                                      "enable_chunked_prefill": False}),
])
def test_add_request_rejects_requests_that_can_never_run(message, bad, kw):
    with pytest.raises(ValueError, match=message):
        make(**kw).add_request(bad)


def test_duplicate_request_id_is_rejected():
    sched = make()
    sched.add_request(req("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(req("a", 3))


@pytest.mark.parametrize(("seed", "mode", "chunked", "caching", "prefill_first"), [
    (0, "recompute", True, True, False), (1, "swap", True, True, False), (2, "recompute", False, True, False),
    (3, "swap", False, False, False), (4, "recompute", True, True, True), (5, "swap", True, False, True),
    (6, "swap", False, True, True), (7, "recompute", True, False, True),
])
def test_random_workload_on_a_tight_pool_keeps_every_token_right_and_leaks_nothing(
        seed, mode, chunked, caching, prefill_first):
    rng = random.Random(seed)
    sched = make(num_blocks=13, max_num_batched_tokens=16, max_num_seqs=6, max_model_len=40,
                 preemption_mode=mode, num_cpu_blocks=8, enable_chunked_prefill=chunked,
                 enable_prefix_caching=caching, prefill_first=prefill_first)
    device = FakeDevice(sched)
    shared = list(range(500, 508))
    pending, expected_prefix, steps = [], {}, 0
    for i in range(24):
        tail = [rng.randrange(1, 90) for _ in range(rng.randrange(1, 9))]
        prompt = (shared if rng.random() < 0.5 else []) + tail
        pending.append(req(f"r{i}", prompt, max_tokens=rng.randrange(1, 12), arrival=float(i)))
    requests = list(pending)
    while pending or sched.has_unfinished():
        while pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        running = [r for r in sched.running if r.num_output_tokens]
        if running and len(expected_prefix) < 8 and rng.random() < 0.2:  # the child continues on its own
            parent = rng.choice(running)
            child_id = f"{parent.request_id}-fork{len(expected_prefix)}"
            child = req(child_id, parent.prompt_token_ids, max_tokens=parent.max_tokens)
            sched.fork_request(parent.request_id, child)
            expected_prefix[child.request_id] = list(child.output_token_ids)
            requests.append(child)
        if sched.requests and rng.random() < 0.03:  # a client goes away, in any state
            victim = sched.requests[rng.choice(sorted(sched.requests))]
            sched.abort(victim.request_id)
        decoding = {r.request_id for r in sched.running if r.num_output_tokens and r.num_tokens_to_compute == 1}
        before = copy.deepcopy(sched) if prefill_first and sched._prompts_fill_a_step() else None
        out = sched.schedule()
        assert out.num_scheduled_tokens <= 16 and len(out.scheduled) <= 6
        if before is not None and any(s.request_id in decoding for s in out.scheduled):
            # Decodes ran while prompts filled a step: only as the fallback, when no prompt work could run alone
            # (a prompt without pages; the mixed step may then start a smaller chunk of it in what is left).
            alone = SchedulerOutput(finished_ids=[])
            before._fill(alone, prompts_only=True)
            assert not alone.scheduled and not alone.preempted, "a decode ran beside prompt work"
        if out.scheduled and rng.random() < 0.05:  # ... or goes away while its step runs
            sched.abort(rng.choice(out.scheduled).request_id)
        sched.update(out, device.run(out))
        sched.block_manager.check_invariants()
        steps += 1
        assert steps < 2000, "no progress"
    aborted = 0
    for r in requests:
        n, k = r.num_prompt_tokens, len(expected_prefix.get(r.request_id, ()))
        tail = [next_token(r, p) for p in range(n - 1 + k, n - 1 + r.max_tokens)]
        expected = expected_prefix.get(r.request_id, []) + tail
        if r.status == RequestStatus.FINISHED_ABORTED:
            aborted += 1
            assert r.output_token_ids == expected[:r.num_output_tokens]
        else:
            assert r.status == RequestStatus.FINISHED_LENGTH
            assert r.output_token_ids == expected
    assert 0 < aborted < len(requests) // 2
    assert_no_leaks(sched)
