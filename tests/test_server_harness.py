"""Starts the real `jengine serve` as a subprocess on 127.0.0.1 (a free port) for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

MODEL = "jengine/tiny-llama"
API_KEY = "test-key"
CHAT = [{"role": "user", "content": "hi"}]
SMALL_ENGINE = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                "--token-buckets", "16,64", "--seq-buckets", "8"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *extra: str, api_key: str | None = API_KEY, timeout: float = 120.0, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        args = [sys.executable, "-m", "jengine.cli", "serve", MODEL, "--port", str(self.port),
                "--uvicorn-log-level", "warning", *SMALL_ENGINE, *extra]
        if api_key:
            args += ["--api-key", api_key]
        env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.proc.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy in time")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """Unlabelled-by-reason sample values of /metrics: {'jengine:num_requests_running': 0.0, ...}."""
        values = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith("jengine:") and "{" in line:
                name, rest = line.split("{", 1)
                labels, value = rest.rsplit("} ", 1)
                reason = [p.split("=")[1].strip('"') for p in labels.split(",") if p.startswith("finished_reason")]
                values[name + (f"[{reason[0]}]" if reason else "")] = float(value)
        return values

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """/metrics once nothing runs, waits and no KV page is held (or at the timeout, for the caller's asserts)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["jengine:num_requests_running"], m["jengine:num_requests_waiting"],
                    m["jengine:kv_cache_usage_perc"]) == (0, 0, 0) or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def abandon_stream(self, body: dict, after_lines: int) -> None:
        """Start a streaming completion and disconnect after reading `after_lines` lines."""
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, headers=self.headers) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == after_lines:
                    break

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def tokenize_chat(srv, **body) -> list[int]:
    """A running server's /tokenize of a conversation (CHAT unless body's messages say otherwise)."""
    r = httpx.post(f"{srv.url}/tokenize", json={"messages": CHAT} | body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]
