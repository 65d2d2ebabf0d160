"""Helpers for the serving tests: a free port, a uvicorn server in a thread, the bare model's greedy output and a
brute-force record of what each namespace cached."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server_thread(app: Any, timeout_s: float = 30.0) -> Iterator[str]:
    """Run ``app`` on uvicorn at 127.0.0.1:<free port> in a thread; yields the base URL; stops it after."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, deadline: float) -> None:
    """Return once ``url``/health answers 200; RuntimeError with ``log`` if ``proc`` exits or ``deadline`` (a
    ``time.monotonic()`` value) passes first."""
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"prefixcache serve did not come up:\n{log.read_text()}")
        time.sleep(0.1)


@contextmanager
def cli_server(args: list[str], log: Path, timeout_s: float = 180.0) -> Iterator[tuple[subprocess.Popen, str]]:
    """``prefixcache serve ARGS --port <free>`` as a subprocess (output to ``log``); yields (process, base URL)
    once /health answers; kills it after if it is still running."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    cmd = [sys.executable, "-c", "from prefixcache.cli import main; main()", "serve", *args, "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(proc, url, log, time.monotonic() + timeout_s)
            yield proc, url
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def bare_greedy(model: Any, tokens: list[int], max_new_tokens: int) -> list[int]:
    """The unwrapped model's greedy continuation of ``tokens`` (stops at its EOS, as generate does)."""
    ids = torch.tensor([tokens])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(tokens) :].tolist()


class Committed:
    """What each namespace has cached, kept independently of the server: every finished request caches its
    prompt and all but its last generated token (the last one has no KV yet); nothing is evicted."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seqs: dict[str, list[list[int]]] = {}

    def add(self, namespace: str, prompt: list[int], generated: list[int]) -> None:
        self.seqs.setdefault(namespace, []).append(prompt + generated[:-1])

    def expect(self, namespace: str, prompt: list[int]) -> int:
        """Tokens a request would be served from cache: the longest common prefix with anything cached in its
        namespace, in whole blocks, leaving at least one token."""
        best = 0
        for seq in self.seqs.get(namespace, []):
            n = 0
            for a, b in zip(prompt, seq):
                if a != b:
                    break
                n += 1
            best = max(best, n // self.block_size)
        return min(best, (len(prompt) - 1) // self.block_size) * self.block_size
