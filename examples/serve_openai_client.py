"""Start `prefixcache serve`, call it with the `openai` client, print the same call as a `curl` line, shut it down.

The server listens on 127.0.0.1 at a free port. Two completions share a long prompt: the second is served most
of it from the cache, which the answer reports as `usage.prompt_tokens_details.cached_tokens`.

    python examples/serve_openai_client.py               # the built-in `small` preset
    python examples/serve_openai_client.py --model tiny  # seconds
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from openai import OpenAI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_up(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"prefixcache serve exited with status {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"prefixcache serve did not answer /health within {timeout_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="a preset (tiny, small) or a local model folder")
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # The server's pool: 8,192 tokens of KV (for `small` in fp32, 73,728 bytes per token: 604 MB).
    cmd = [sys.executable, "-m", "prefixcache", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--max-cached-tokens", "8192"]
    log = Path(tempfile.mkdtemp(prefix="prefixcache-serve-")) / "serve.log"
    print("starting:", " ".join(cmd[1:]), f"(its log: {log})")
    with open(log, "w") as out:  # the server keeps its own handle
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_up(server, url, log)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")  # the server checks no key
        model = client.models.list().data[0].id

        system = "You are a terse assistant for a hardware shop. Answer with a part number when you can. " * 8
        for question in ["Which cable fits a 2019 laptop?", "Which charger fits the same laptop?"]:
            done = client.completions.create(model=model, prompt=system + question, max_tokens=8, temperature=0)
            usage = done.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            cached = usage.prompt_tokens_details.cached_tokens
            text = done.choices[0].text  # random weights: the text is noise
            print(f"completion: {usage.prompt_tokens} prompt tokens, {cached} from cache: {text!r}")

        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, stream=True
        )
        print("chat, streamed:", "".join(chunk.choices[0].delta.content or "" for chunk in chat if chunk.choices))

        body = {"model": model, "prompt": "Hello", "max_tokens": 8}
        print("the same from a shell:")
        print(f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{json.dumps(body)}'")

        metrics = httpx.get(f"{url}/metrics", timeout=10.0).text
        wanted = ("prefixcache_cache_token_hit_rate", "prefixcache_cache_cached_tokens_total")
        for line in metrics.splitlines():
            if line.startswith(wanted):
                print("metrics:", line)
    finally:
        server.send_signal(signal.SIGINT)  # running requests finish, then it exits 0
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    print("server stopped, status", server.returncode)


if __name__ == "__main__":
    main()
