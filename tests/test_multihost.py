"""Multi-host on one machine: two processes (2 CPU devices each, loopback coordinator, gloo collectives)
run `jengine generate` at tensor_parallel_size 4 across both and print what one process at TP 1 prints."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

ARGS = ["generate", "jengine/tiny-llama", "--max-tokens", "6", "--max-model-len", "64", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "32", "--dtype", "float32", "--prompt", "Hello, my name is", "--prompt", "JAX"]


def _run(*extra: str, devices: int = 1, env_extra: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               **(env_extra or {}))
    return subprocess.Popen([sys.executable, "-m", "jengine.cli", *ARGS, *extra], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _lines(proc: subprocess.Popen) -> list[dict]:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_two_processes_at_tp4_generate_what_one_process_at_tp1_does():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    coordinator = ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2"]
    workers = [_run(*coordinator, "--process-id", "0", "--tensor-parallel-size", "4", devices=2),
               _run("--tensor-parallel-size", "4", devices=2,  # process 1 from the environment, as on pods
                    env_extra={"JENGINE_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JENGINE_NUM_PROCESSES": "2",
                               "JENGINE_PROCESS_ID": "1"})]
    single = _lines(_run())
    main, other = (_lines(w) for w in workers)
    assert len(single) == 2 and all(len(line["token_ids"]) == 6 for line in single)
    assert main == single
    assert other == []  # only process 0 reports
