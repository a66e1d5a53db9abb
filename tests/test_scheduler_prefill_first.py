"""The scheduler's `prefill_first` policy: prompt-only steps while the prompts that could start fill a step,
mixed steps otherwise, no preemption in a prompt-only step, and admission within `max_num_seqs`. The random
workloads of test_scheduler.py run it too."""

from test_scheduler import assert_no_leaks, make, plan, req, step


def test_prefill_first_runs_prompt_only_steps_while_prompts_fill_the_budget():
    sched = make(max_num_batched_tokens=8, prefill_first=True)
    sched.add_request(req("a", 3, max_tokens=6, arrival=0))
    step(sched)
    sched.add_request(req("b", 10, max_tokens=2, arrival=1))
    sched.add_request(req("c", range(60, 66), max_tokens=3, arrival=2))  # no prefix shared with a or b
    plans = [plan(step(sched)[0]) for _ in range(3)]
    assert plans == [
        [("b", 0, 8, False)],  # 16 prompt tokens queued: a, decoding, waits
        [("b", 8, 2, True), ("c", 0, 6, True)],  # still 8, a full step
        [("a", 3, 1, True), ("b", 10, 1, True), ("c", 6, 1, True)],
    ]
    sched.add_request(req("d", 3, max_tokens=1, arrival=3))  # less than a step: mixed with the decodes
    assert plan(step(sched)[0]) == [("a", 4, 1, True), ("c", 7, 1, True), ("d", 0, 3, True)]


def test_prefill_first_decodes_when_the_queued_prompts_cannot_get_pages():
    # 4 pages of 4 tokens: a holds 2, b's 10-token prompt needs 3 (chunked prefill off), so the prompt-only
    # step finds nothing to run and the step decodes instead of idling.
    sched = make(num_blocks=5, max_num_batched_tokens=10, enable_chunked_prefill=False, prefill_first=True)
    sched.add_request(req("a", 6, max_tokens=5, arrival=0))
    step(sched)
    sched.add_request(req("b", range(50, 60), max_tokens=1, arrival=1))  # no prefix shared with a
    plans = [plan(step(sched)[0]) for _ in range(5)]
    assert plans == [[("a", 6 + i, 1, True)] for i in range(4)] + [[("b", 0, 10, True)]]
    assert_no_leaks(sched)


def test_prefill_first_counts_only_the_queued_prompts_that_have_a_seat():
    # max_num_seqs=2: a decodes and p has 2 prompt tokens left; c's 10 have no seat, so the prompts do not fill
    # a step (2 < 8) and the step mixes a's decode with p's last chunk.
    sched = make(max_num_seqs=2, max_num_batched_tokens=8, prefill_first=True)
    sched.add_request(req("a", 3, max_tokens=6, arrival=0))
    step(sched)
    sched.add_request(req("p", range(50, 60), max_tokens=2, arrival=1))
    assert plan(step(sched)[0]) == [("p", 0, 8, False)]  # 10 prompt tokens with a seat: a waits
    sched.add_request(req("c", range(70, 80), max_tokens=1, arrival=2))
    assert plan(step(sched)[0]) == [("a", 3, 1, True), ("p", 8, 2, True)]
    assert plan(step(sched)[0]) == [("a", 4, 1, True), ("p", 10, 1, True)]  # p ends: c gets its seat
    assert plan(step(sched)[0]) == [("c", 0, 8, False)]
    while sched.has_unfinished():
        step(sched)
    assert_no_leaks(sched)


def test_admission_never_runs_more_than_max_num_seqs_requests():
    # A prompt-only step holds fewer requests than are running, so admission counts the running queue: here
    # cached prefixes leave each newcomer 1 token to compute, and without that count all four would start.
    sched = make(max_num_seqs=3, max_num_batched_tokens=8, prefill_first=True)
    shared = list(range(200, 208))
    sched.add_request(req("a", shared + [1], max_tokens=8, arrival=0))
    for _ in range(3):
        step(sched)
    for i in range(4):
        sched.add_request(req(f"w{i}", shared + [10 + i], max_tokens=8, arrival=1 + i))
    while sched.has_unfinished():
        step(sched)
        assert len(sched.running) <= 3
    assert_no_leaks(sched)


def test_prefill_first_never_preempts_in_a_prompt_only_step():
    # Recompute, no prefix caching, 6 pages: d holds 3 when p and q (16 tokens each) arrive. A prompt whose next
    # chunk found no pages used to preempt itself in a prompt-only step, be readmitted, and do it again, while d
    # never decoded and so never freed a page. Such a step now gives way to the mixed order.
    sched = make(num_blocks=7, max_num_batched_tokens=8, max_num_seqs=4, enable_prefix_caching=False,
                 prefill_first=True)
    sched.add_request(req("d", range(100, 108), max_tokens=12, arrival=0))
    step(sched)
    step(sched)
    sched.add_request(req("p", range(200, 216), max_tokens=4, arrival=1))
    sched.add_request(req("q", range(300, 316), max_tokens=4, arrival=2))
    steps = 0
    while sched.has_unfinished():
        step(sched)
        steps += 1
        assert steps < 60, "no progress"
    assert_no_leaks(sched)
