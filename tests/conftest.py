"""Fixtures shared by the server test modules: a served tiny model per module, and an openai client of it."""

from __future__ import annotations

import pytest
from test_server_harness import API_KEY, Server


@pytest.fixture(scope="module")
def server():
    """The tiny model behind `jengine serve` (a module of its own may define another)."""
    srv = Server()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    import openai  # here, not at the top: the GPU hosts that run the GPU test files lack it

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
