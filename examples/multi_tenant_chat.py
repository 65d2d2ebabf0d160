"""A multi-tenant chat through `prefixcache serve`: each tenant's `cache_salt` keeps its cache to itself.

Two tenants send the same system prompt. Without salts the second tenant would be served the first one's KV;
with a salt each, the second tenant's first turn computes everything (0 cached tokens: nothing is shared across
salts), and every later turn of each tenant hits its own history. The server runs on 127.0.0.1 at a free port
(or pass `--url` of one already running).

    python examples/multi_tenant_chat.py               # the built-in `small` preset
    python examples/multi_tenant_chat.py --model tiny  # seconds
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from openai import OpenAI

TENANTS = ["acme", "globex"]
TURNS = ["Hi, I need help with an order.", "It was order 1234, placed on Monday.", "Can you refund it?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: str) -> tuple[subprocess.Popen[bytes], str]:
    """`prefixcache serve` as a subprocess (its output in a log file); returns it and its URL once /health is ok."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "prefixcache", "serve", "--model", model, "--port", str(port)]
    cmd += ["--max-cached-tokens", "8192"]
    log = Path(tempfile.mkdtemp(prefix="prefixcache-serve-")) / "serve.log"
    with open(log, "w") as out:  # the server keeps its own handle
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"prefixcache serve exited with status {server.returncode}: see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.kill()
    raise SystemExit(f"prefixcache serve did not come up within 120 s: see {log}")


def chat(url: str) -> None:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    system = "You are the support desk of an online shop. Be polite, ask for the order number, never guess. " * 6
    histories = {tenant: [{"role": "system", "content": system}] for tenant in TENANTS}
    for turn, user_text in enumerate(TURNS):
        for tenant in TENANTS:  # tenants interleaved, as a server sees them
            messages = histories[tenant]
            messages.append({"role": "user", "content": user_text})
            reply = client.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=16,
                temperature=0,
                extra_body={"cache_salt": tenant},  # or the header: extra_headers={"X-Cache-Salt": tenant}
            )
            usage = reply.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            cached = usage.prompt_tokens_details.cached_tokens
            print(f"turn {turn + 1}, {tenant:>6}: {usage.prompt_tokens:4} prompt tokens, {cached:4} from cache")
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="a preset (tiny, small) or a local model folder")
    parser.add_argument("--url", help="a running prefixcache serve (default: start one)")
    args = parser.parse_args()
    if args.url:
        chat(args.url)
        return
    server, url = start_server(args.model)
    try:
        chat(url)
    finally:
        server.send_signal(signal.SIGINT)  # running requests finish, then it exits 0
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
