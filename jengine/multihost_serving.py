"""Multi-host serving: process 0 takes the requests, every process runs the same engine in lockstep.

A tensor-parallel mesh that spans processes runs one program on all of them, and its collectives need
every process to launch the same programs in the same order. So every process holds an identical engine
and applies identical commands at identical points: process 0 (the leader, behind the HTTP server)
wraps its engine in `LeaderEngine`, which records the commands it applies (add with the token ids and
the full sampling params, abort, embed) and, before each engine step, publishes them as one record in
the key-value store of JAX's own coordinator (`jax.distributed`). The other processes (followers) run
`follow(engine)`: read record k, apply its commands, then step (or stop). A step's device work never
waits on the channel: the leader only writes a small record before launching.

Idle costs nothing: the leader publishes only when it steps; followers wait in a blocking get that they
renew on its timeout. Shutdown is a record too, so followers drain and exit 0. The last reader of a
record deletes it, so the store does not grow.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

from jengine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

_PREFIX = "jengine/serve"
_WAIT_MS = 60_000  # one blocking get; renewed while the leader is idle


def encode_params(params: SamplingParams) -> dict:
    """Every field of the params as JSON-safe data (logit_bias keys become strings, the output kind
    its name; decoding restores them)."""
    return {**dataclasses.asdict(params), "output_kind": params.output_kind.name}


def decode_params(data: dict) -> SamplingParams:
    return SamplingParams(**{**data, "output_kind": RequestOutputKind[data["output_kind"]]})


class Channel:
    """Numbered records from process 0 to the others through the jax.distributed key-value store."""

    def __init__(self, client=None, num_processes: int | None = None):
        if client is None:
            import jax
            from jax._src.distributed import global_state

            client, num_processes = global_state.client, jax.process_count()
        if client is None:
            raise RuntimeError("multi-host serving needs jax.distributed to be initialized first")
        self.client, self.num_followers = client, num_processes - 1
        self.next = 0  # number of the next record to publish (leader) or read (follower)

    def publish(self, record: dict) -> None:
        self.client.key_value_set(f"{_PREFIX}/record/{self.next}", json.dumps(record))
        self.next += 1

    def receive(self) -> dict:
        key = f"{_PREFIX}/record/{self.next}"
        while True:
            try:
                text = self.client.blocking_key_value_get(key, _WAIT_MS)
                break
            except Exception as e:  # the leader is idle: wait again; anything else is fatal
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        readers = f"{_PREFIX}/read/{self.next}"
        if self.client.key_value_increment(readers, 1) == self.num_followers:  # the last reader cleans up
            self.client.key_value_delete(key)
            self.client.key_value_delete(readers)
        self.next += 1
        return json.loads(text)


class LeaderEngine:
    """Process 0's engine: applies each command locally and queues it for the followers; `step()`
    publishes the queue, then steps. Everything else is the wrapped engine's (attribute delegation)."""

    def __init__(self, engine, channel: Channel | None = None):
        self.engine = engine
        self.channel = channel or Channel()
        self._commands: list = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, *, priority: int = 0,
                    arrival_time: float | None = None) -> list[int]:
        params = params or SamplingParams()
        arrival_time = time.time() if arrival_time is None else arrival_time
        ids = self.engine.add_request(request_id, prompt, params, priority=priority, arrival_time=arrival_time)
        self._commands.append(["add", request_id, ids, encode_params(params), priority, arrival_time])
        return ids

    def abort_request(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._commands.append(["abort", request_id])

    def step(self):
        self._publish("step")
        return self.engine.step()

    def embed(self, token_ids: list[int]) -> list[float]:
        """The embedding program spans every process, so the followers must start it now, not at the
        next step (this call blocks until it completes)."""
        from jengine.entrypoints.pooling import embed

        self._commands.append(["embed", [int(t) for t in token_ids]])
        self._publish("nothing")
        return embed(self.engine, token_ids)

    def close(self) -> None:
        """Tell the followers to stop (after the commands still queued, e.g. the last aborts)."""
        self._publish("stop")

    def _publish(self, then: str) -> None:
        self.channel.publish({"commands": self._commands, "then": then})
        self._commands = []


def follow(engine, channel: Channel | None = None) -> int:
    """A follower's whole life: apply process 0's records to `engine` until it says stop; returns the
    number of steps taken."""
    from jengine.entrypoints.pooling import embed

    channel = channel or Channel()
    steps = 0
    while True:
        record = channel.receive()
        for command in record["commands"]:
            kind = command[0]
            if kind == "add":
                _, request_id, ids, params, priority, arrival_time = command
                engine.add_request(request_id, ids, decode_params(params), priority=priority,
                                   arrival_time=arrival_time)
            elif kind == "abort":
                engine.abort_request(command[1])
            elif kind == "embed":
                try:
                    embed(engine, command[1])
                except ValueError:  # bad input fails the same way, before any device work, on process 0
                    pass
            else:
                raise ValueError(f"unknown command {kind!r} from process 0")
        if record["then"] == "stop":
            engine.drain()
            return steps
        if record["then"] == "step":
            engine.step()
            steps += 1
