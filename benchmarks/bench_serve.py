"""Serving: K concurrent chat clients (the ``openai`` client, streaming, over 127.0.0.1) replay a multi-tenant
chat scenario against ``prefixcache serve`` in four set-ups:

(a) one process, serial (``--max-batch-size 1``), pool of 2P tokens;
(b) one process, batched, pool of 2P tokens;
(c) 2 Ray Serve replicas, pool P each, Ray's default router (power of two choices);
(d) 2 Ray Serve replicas, pool P each, ``PrefixAwareRouter`` (prefix_balanced).

Each client plays whole conversations, turn after turn, the model's replies joining the history. Reported:
requests/s, cluster token hit rate (sum of ``cached_tokens`` / sum of prompt tokens, from the responses' usage),
time to first token p50/p99 (client side), requests per replica (from /metrics) and their max/min.
Targets: (b) >= 1.5x (a) requests/s; (d) hit rate >= 1.5x (c)'s and >= 0.9x (b)'s, max/min <= 1.5.
Every server is a ``prefixcache serve`` subprocess on 127.0.0.1; each set-up is bounded in requests and seconds.

    python benchmarks/bench_serve.py [--clients 8] [--setups abcd] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from rich.console import Console
from rich.table import Table

from prefixcache.workload.generators import generate

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Setup:
    key: str
    label: str
    args: tuple[str, ...]
    pool_factor: int  # pool per process, in units of P


SETUPS = {
    "a": Setup("a", "1 process, serial", ("--max-batch-size", "1"), 2),
    "b": Setup("b", "1 process, batched", ("--max-batch-size", "8"), 2),
    "c": Setup("c", "2 Ray replicas, Ray's router", ("--replicas", "2", "--router", "ray_default"), 1),
    "d": Setup("d", "2 Ray replicas, PrefixAwareRouter", ("--replicas", "2", "--router", "prefix_balanced"), 1),
}


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0
    errors: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server(args: list[str], log: Path, startup_s: float) -> Iterator[str]:
    """``prefixcache serve ARGS`` on a free port until /health answers; SIGTERM (then kill) afterwards."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-c", "from prefixcache.cli import main; main()", "serve", *args, "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + startup_s
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start ({' '.join(args)}); see {log}")
                time.sleep(0.25)
            yield url
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def conversations(args: argparse.Namespace) -> list[tuple[str, list[list[dict]]]]:
    """(cache salt, turns) per conversation; a turn is the list of its new messages."""
    reqs = generate(
        "chat",
        seed=args.seed,
        users=args.users,
        turns=args.turns,
        system_prompt_tokens=args.system_tokens,
        user_tokens=args.user_tokens,
        tenants=args.tenants,
        interleave=False,
    )
    convs: dict[str, tuple[str, list[list[dict]]]] = {}
    for r in reqs:
        assert r.messages is not None and r.conversation is not None
        _, turns = convs.setdefault(r.conversation, (r.namespace, []))
        turns.append([{"role": m.role, "content": m.content} for m in r.messages])
    return list(convs.values())


def replica_series(url: str, name: str) -> dict[str, float]:
    """A per-replica series from /metrics (e.g. prefixcache_cache_lookups_total: one per request)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            out[line.split('replica="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def counters(url: str) -> dict[str, dict[str, float]]:
    names = ("prefixcache_cache_lookups_total", "prefixcache_batches_total", "prefixcache_batch_rows_total")
    return {n: replica_series(url, n) for n in names}


def play(url: str, model: str, convs: list, clients: int, max_tokens: int, budget_s: float) -> tuple[Result, float]:
    """K client threads play the conversations (each one turn after turn); returns the result and wall seconds."""
    todo: queue.Queue = queue.Queue()
    for c in convs:
        todo.put(c)
    result = Result()
    lock = threading.Lock()
    stop_at = time.monotonic() + budget_s

    def client() -> None:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        while time.monotonic() < stop_at:
            try:
                salt, turns = todo.get_nowait()
            except queue.Empty:
                return
            history: list[dict] = []
            for new in turns:
                if time.monotonic() >= stop_at:
                    return
                history += new
                t0 = time.perf_counter()
                first = None
                reply, usage = [], None
                try:
                    stream = api.chat.completions.create(
                        model=model,
                        messages=history,
                        max_tokens=max_tokens,
                        temperature=0,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"cache_salt": salt},
                    )
                    for chunk in stream:
                        if first is None:
                            first = time.perf_counter() - t0
                        if chunk.choices:
                            reply.append(chunk.choices[0].delta.content or "")
                        if chunk.usage is not None:
                            usage = chunk.usage
                except openai.APIError:
                    with lock:
                        result.errors += 1
                    break
                history.append({"role": "assistant", "content": "".join(reply)})
                with lock:
                    result.requests += 1
                    if first is not None:
                        result.ttft.append(first)
                    if usage is not None:
                        result.prompt_tokens += usage.prompt_tokens
                        result.cached_tokens += usage.prompt_tokens_details.cached_tokens

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return result, time.perf_counter() - t0


def warm_up(url: str, model: str) -> None:
    """A few requests in their own tenant, so first-call costs stay out of the figures."""
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    for i in range(4):
        api.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"warm up {i}"}],
            max_tokens=2,
            extra_body={"cache_salt": "warm-up"},
        )


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def run_setup(setup: Setup, args: argparse.Namespace, convs: list, logdir: Path) -> dict:
    pool = setup.pool_factor * args.replica_cache_tokens
    cli = [*setup.args, "--model", args.model, "--max-cached-tokens", str(pool), "--batch-wait-ms", "2"]
    with server(cli, logdir / f"server_{setup.key}.log", args.startup_s) as url:
        warm_up(url, args.model)
        before = counters(url)
        result, wall = play(url, args.model, convs, args.clients, args.max_tokens, args.budget_s)
        after = counters(url)

    def delta(name: str) -> dict[str, float]:
        return {r: v - before[name].get(r, 0.0) for r, v in after[name].items()}

    per_replica = sorted(delta("prefixcache_cache_lookups_total").values())
    batches = sum(delta("prefixcache_batches_total").values())
    return {
        "setup": setup.key,
        "label": setup.label,
        "pool_tokens_per_process": pool,
        "requests": result.requests,
        "errors": result.errors,
        "wall_s": wall,
        "requests_per_s": result.requests / wall if wall else 0.0,
        "token_hit_rate": result.cached_tokens / result.prompt_tokens if result.prompt_tokens else 0.0,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "ttft_p50_ms": 1000 * pct(result.ttft, 0.5),
        "ttft_p99_ms": 1000 * pct(result.ttft, 0.99),
        "ttft_mean_ms": 1000 * statistics.fmean(result.ttft) if result.ttft else float("nan"),
        "requests_per_replica": per_replica,
        "mean_batch_size": sum(delta("prefixcache_batch_rows_total").values()) / batches if batches else None,
        "max_over_min": (per_replica[-1] / per_replica[0]) if per_replica and per_replica[0] else None,
    }


def targets(rows: dict[str, dict]) -> list[tuple[str, float, float, bool]]:
    """(what, measured, target, met) for each target whose set-ups ran."""
    out = []
    if {"a", "b"} <= rows.keys():
        r = rows["b"]["requests_per_s"] / rows["a"]["requests_per_s"]
        out.append(("(b)/(a) requests/s", r, 1.5, r >= 1.5))
    if {"c", "d"} <= rows.keys():
        r = rows["d"]["token_hit_rate"] / max(rows["c"]["token_hit_rate"], 1e-9)
        out.append(("(d)/(c) token hit rate", r, 1.5, r >= 1.5))
    if {"b", "d"} <= rows.keys():
        r = rows["d"]["token_hit_rate"] / max(rows["b"]["token_hit_rate"], 1e-9)
        out.append(("(d)/(b) token hit rate (same total cache)", r, 0.9, r >= 0.9))
    if "d" in rows and rows["d"]["max_over_min"] is not None:
        r = rows["d"]["max_over_min"]
        out.append(("(d) max/min requests per replica", r, 1.5, r <= 1.5))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setups", default="abcd", help="which set-ups to run (letters a-d)")
    ap.add_argument("--model", default="tiny", help="built-in preset or local model directory")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients (K)")
    ap.add_argument("--tenants", type=int, default=4, help="tenants (cache salts)")
    ap.add_argument("--users", type=int, default=24, help="conversations")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation")
    ap.add_argument("--system-tokens", type=int, default=300, help="system prompt length (byte tokens)")
    ap.add_argument("--user-tokens", type=int, default=120, help="user message length (byte tokens)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per turn")
    ap.add_argument("--replica-cache-tokens", type=int, default=4096, help="P: pool per Ray replica, in tokens")
    ap.add_argument("--budget-s", type=float, default=300.0, help="time limit of one set-up's load")
    ap.add_argument("--startup-s", type=float, default=300.0, help="time limit of one server's start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the results as JSON")
    args = ap.parse_args()
    convs = conversations(args)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
        for key in args.setups:
            rows[key] = run_setup(SETUPS[key], args, convs, Path(tmp))

    table = Table(
        title=f"serve: {args.clients} clients, {len(convs)} chats x {args.turns} turns, {args.tenants} tenants, "
        f"model {args.model}, P = {args.replica_cache_tokens} tokens"
    )
    cols = ("set-up", "pool/process", "requests", "req/s", "token hit", "TTFT p50 ms", "TTFT p99 ms", "mean batch")
    for col in (*cols, "per replica", "max/min"):
        table.add_column(col, justify="left" if col == "set-up" else "right")
    for r in rows.values():
        table.add_row(
            f"({r['setup']}) {r['label']}",
            f"{r['pool_tokens_per_process']:,}",
            f"{r['requests']}" + (f" ({r['errors']} err)" if r["errors"] else ""),
            f"{r['requests_per_s']:.2f}",
            f"{r['token_hit_rate']:.3f}",
            f"{r['ttft_p50_ms']:.0f}",
            f"{r['ttft_p99_ms']:.0f}",
            "-" if r["mean_batch_size"] is None else f"{r['mean_batch_size']:.1f}",
            "/".join(f"{n:.0f}" for n in r["requests_per_replica"]),
            "-" if r["max_over_min"] is None else f"{r['max_over_min']:.2f}",
        )
    console = Console() if Console().is_terminal else Console(width=150)
    console.print(table)
    checks = targets(rows)
    for what, value, target, met in checks:
        op = "<=" if "max/min" in what else ">="
        console.print(f"{what}: {value:.2f} (target {op} {target}) {'OK' if met else 'MISSED'}")
    if args.json:
        payload = {"args": vars(args) | {"json": str(args.json)}, "rows": list(rows.values())}
        payload["targets"] = [{"what": w, "value": v, "target": t, "met": m} for w, v, t, m in checks]
        args.json.write_text(json.dumps(payload, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
