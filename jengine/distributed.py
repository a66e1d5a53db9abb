"""Multi-host: the same program on every host through JAX's own multi-controller runtime.

`initialize` must run before anything touches a device. Afterwards `jax.devices()` lists the devices
of every process, the tensor-parallel mesh spans hosts, and every process runs the same engine on the
same requests, so the schedulers take the same decisions and launch the same programs (collectives
need that). No home-made RPC: the only channel between processes is JAX's (coordinator + collectives).
Only process 0 reports results. On the CPU the cross-process collectives are gloo's. The server gets
its requests on process 0 only and hands them to the others in lockstep (`jengine.multihost_serving`).
"""

from __future__ import annotations

import jax


def initialize(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """Join a multi-process run when a coordinator is given; returns whether one was joined."""
    if not coordinator_address:
        if num_processes not in (None, 1):
            raise ValueError(f"--num-processes {num_processes} needs --coordinator-address host:port")
        return False
    if num_processes is None or process_id is None or not 0 <= process_id < num_processes:
        raise ValueError(f"a multi-process run needs --num-processes and a --process-id in [0, num_processes), got "
                         f"--num-processes {num_processes}, --process-id {process_id}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU client reads it
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    return True


def is_main_process() -> bool:
    return jax.process_index() == 0
