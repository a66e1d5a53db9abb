"""The multi-host serving channel on plain objects (no processes): process 0's `LeaderEngine` records
commands into numbered records, `follow` replays them on another engine; and the serve flags that
cannot work are refused before anything starts."""

from __future__ import annotations

import json

import pytest

from jengine import cli
from jengine.multihost_serving import Channel, LeaderEngine, decode_params, encode_params, follow
from jengine.sampling_params import RequestOutputKind, SamplingParams


class FakeStore:
    """The part of jax.distributed's client the channel uses; a missing key times out at once."""

    def __init__(self, timeouts_before_each_get: int = 0):
        self.data: dict[str, str] = {}
        self.counters: dict[str, int] = {}
        self.timeouts_left = self.timeouts_per_get = timeouts_before_each_get
        self.timeouts = 0

    def key_value_set(self, key, value, allow_overwrite=False):
        assert key not in self.data and isinstance(value, str)
        self.data[key] = value

    def blocking_key_value_get(self, key, timeout_in_ms):
        if self.timeouts_left or key not in self.data:
            self.timeouts_left = max(0, self.timeouts_left - 1)
            self.timeouts += 1
            raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
        self.timeouts_left = self.timeouts_per_get
        return self.data[key]

    def key_value_increment(self, key, increment):
        self.counters[key] = self.counters.get(key, 0) + increment
        return self.counters[key]

    def key_value_delete(self, key):
        self.data.pop(key, None)
        self.counters.pop(key, None)


class FakeEngine:
    """Records the calls a follower makes; tokenizes text as its characters' code points."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.config = "config"

    def tokenize_prompt(self, prompt):
        return (prompt, [ord(c) for c in prompt]) if isinstance(prompt, str) else (None, list(prompt))

    def add_request(self, request_id, prompt, params=None, *, priority=0, arrival_time=None):
        if request_id == "bad":
            raise ValueError("bad request")
        ids = self.tokenize_prompt(prompt)[1]
        self.calls.append(("add", request_id, ids, params, priority, arrival_time))
        return ids

    def abort_request(self, request_id):
        self.calls.append(("abort", request_id))

    def step(self):
        self.calls.append(("step",))
        return []

    def drain(self):
        self.calls.append(("drain",))
        return []


RICH = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=1234, stop=["\n\n", "END"],
                      stop_token_ids=[7, 9], max_tokens=33, min_tokens=2, logprobs=3, prompt_logprobs=1,
                      logit_bias={5: -3.5, 11: 100.0}, presence_penalty=0.5, frequency_penalty=-0.25,
                      repetition_penalty=1.1, include_stop_str_in_output=True, skip_special_tokens=False,
                      allowed_token_ids=[5, 7, 11, 300], bad_words=["foo", " bar"])


def test_sampling_params_cross_the_channel_unchanged():
    delta = SamplingParams(output_kind=RequestOutputKind.DELTA)
    for params in (RICH, SamplingParams(), SamplingParams(temperature=0, ignore_eos=True, max_tokens=None), delta):
        assert decode_params(json.loads(json.dumps(encode_params(params)))) == params


def test_follower_replays_the_leaders_commands_in_order_and_the_store_is_emptied(monkeypatch):
    store = FakeStore()
    embedded = []
    monkeypatch.setattr("jengine.entrypoints.pooling.embed", lambda engine, ids: embedded.append((engine, ids)))
    leader_inner, follower = FakeEngine(), FakeEngine()
    leader = LeaderEngine(leader_inner, Channel(store, num_processes=2))
    assert leader.config == "config"  # everything else is the wrapped engine's
    leader.add_request("a", "hi", RICH, priority=3, arrival_time=12.25)
    with pytest.raises(ValueError):
        leader.add_request("bad", "x")  # refused on process 0: never sent
    leader.abort_request("a")
    leader.step()
    leader.add_request("b", [4, 5, 6])
    leader.embed([1, 2])
    leader.step()
    leader.abort_request("b")
    leader.close()

    assert follow(follower, Channel(store, num_processes=2)) == 2
    assert follower.calls == leader_inner.calls + [("drain",)]
    assert follower.calls[0] == ("add", "a", [104, 105], RICH, 3, 12.25)
    assert follower.calls[3][5] is not None  # arrival time fixed on process 0, the same everywhere
    assert [ids for _, ids in embedded] == [[1, 2], [1, 2]] and embedded[1][0] is follower
    assert store.data == {} and store.counters == {}


def test_records_stay_until_every_follower_has_read_them():
    store = FakeStore()
    leader = LeaderEngine(FakeEngine(), Channel(store, num_processes=3))
    leader.step()
    leader.close()
    first, second = FakeEngine(), FakeEngine()
    follow(first, Channel(store, num_processes=3))
    assert len(store.data) == 2  # the other follower has not read them yet
    follow(second, Channel(store, num_processes=3))
    assert first.calls == second.calls == [("step",), ("drain",)] and store.data == {}


def test_an_idle_leader_only_makes_followers_wait_again():
    store = FakeStore(timeouts_before_each_get=3)
    LeaderEngine(FakeEngine(), Channel(store, num_processes=2)).close()
    assert follow(FakeEngine(), Channel(store, num_processes=2)) == 0
    assert store.timeouts == 3


def test_a_lost_coordinator_ends_the_follower():
    class Gone(FakeStore):
        def blocking_key_value_get(self, key, timeout_in_ms):
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")

    with pytest.raises(RuntimeError, match="UNAVAILABLE"):
        follow(FakeEngine(), Channel(Gone(), num_processes=2))


def test_unknown_commands_are_refused():
    store = FakeStore()
    Channel(store, num_processes=2).publish({"commands": [["reboot"]], "then": "step"})
    with pytest.raises(ValueError, match="unknown command 'reboot'"):
        follow(FakeEngine(), Channel(store, num_processes=2))


@pytest.mark.parametrize("argv,env,message", [
    (["--data-parallel-size", "4096"], {}, "data_parallel_size=4096 replicas of tensor_parallel_size=1 devices need"),
    (["--data-parallel-size", "2", "--tensor-parallel-size", "3"], {}, "tensor_parallel_size=3 must divide"),
    (["--data-parallel-size", "0"], {}, "data_parallel_size must be a positive integer"),
    (["--num-processes", "2"], {}, "--num-processes 2 needs --coordinator-address"),
    (["--coordinator-address", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"], {}, "--process-id 2"),
    (["--coordinator-address", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0",
      "--data-parallel-size", "2"], {}, "--data-parallel-size 2 is not supported with --num-processes 2"),
    ([], {"JENGINE_NUM_PROCESSES": "two"}, "$JENGINE_NUM_PROCESSES must be an integer"),
])
def test_serve_refuses_flags_that_cannot_work(argv, env, message, monkeypatch, capsys):
    for name in ("JENGINE_COORDINATOR_ADDRESS", "JENGINE_NUM_PROCESSES", "JENGINE_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["serve", "jengine/tiny-llama", *argv]) == 2
    assert message in capsys.readouterr().err
