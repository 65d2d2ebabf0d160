"""Serving: K concurrent chat clients (the ``openai`` client, streaming, over 127.0.0.1) replay a multi-tenant
chat scenario against ``prefixcache serve`` in four set-ups:

(a) one process, serial (``--max-running 1``: the engine runs one request at a time);
(b) one process, batched (the engine's defaults: continuous batching);
(c) 2 Ray Serve replicas, pool P each, Ray's default router (power of two choices);
(d) 2 Ray Serve replicas, pool P each, ``PrefixAwareRouter`` (prefix_balanced).

Each client plays whole conversations, turn after turn, the model's replies joining the history. Two phases:

- throughput, (a) and (b): the clients send the next turn at once (the server saturated), the two servers up
  side by side and loaded in alternation round after round, so that the machine's drifting load hits both
  alike; pools of 8P, which hold every chat (a tight pool under a strictly cyclic order, as a serial server
  sees it, is LRU's worst case and would lower (a)'s hit rate too). Target: (b) >= 1.5x (a) requests/s.
- routing, (b') = (b) again as the one-process reference, then (c) and (d): users pause before each turn
  (uniform in 0..2x ``--think-ms``), as people do, so a turn's arrival says nothing of where the previous one
  ran. Targets: (d) token hit rate >= 1.5x (c)'s and >= 0.9x (b')'s, (d) max/min requests per replica <= 1.5.

Reported, as medians over rounds of fresh conversations: requests/s, cluster token hit rate (sum of
``cached_tokens`` / sum of prompt tokens, from the responses' usage), time to first token p50/p99 (client
side), mean batch size, server CPU per request (one process only), requests per replica (from /metrics) and
their max/min. Every server is a ``prefixcache serve`` subprocess on 127.0.0.1; each round is bounded in
requests and seconds.

    python benchmarks/bench_serve.py [--clients 8] [--setups abcd] [--rounds 3] [--batch-wait-ms 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from rich.console import Console
from rich.table import Table

import _meta
from prefixcache.workload.generators import generate

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Setup:
    key: str
    label: str
    args: tuple[str, ...]
    pool_factor: int  # pool per process, in units of P


SETUPS = {
    "a": Setup("a", "1 process, serial", ("--max-running", "1"), 2),
    "b": Setup("b", "1 process, batched", (), 2),
    "c": Setup("c", "2 Ray replicas, Ray's router", ("--replicas", "2", "--router", "ray_default"), 1),
    "d": Setup("d", "2 Ray replicas, PrefixAwareRouter", ("--replicas", "2", "--router", "prefix_balanced"), 1),
}


@dataclass(frozen=True)
class Run:
    """One row: a set-up under one phase's think time."""

    key: str
    setup: Setup
    think_ms: float
    phase: str
    pool_factor: int  # pool per process, in units of P


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
def server(args: list[str], log: Path, startup_s: float) -> Iterator[tuple[str, int]]:
    """``prefixcache serve ARGS`` on a free port until /health answers, as (URL, pid); SIGTERM (then kill)
    afterwards."""
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
                    tail = "\n".join(log.read_text().splitlines()[-40:])
                    raise RuntimeError(f"server did not start ({' '.join(args)}); the end of its log:\n{tail}")
                time.sleep(0.25)
            yield url, proc.pid
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def conversations(args: argparse.Namespace, seed: int) -> list[tuple[str, list[list[dict]]]]:
    """(cache salt, turns) per conversation; a turn is the list of its new messages."""
    reqs = generate(
        "chat",
        seed=seed,
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
    names = (
        "prefixcache_cache_lookups_total",
        "prefixcache_batches_total",
        "prefixcache_batch_rows_total",
        "prefixcache_engine_steps_total",
        "prefixcache_engine_step_requests_total",
    )
    return {n: replica_series(url, n) for n in names}


def play(
    url: str, model: str, convs: list, clients: int, max_tokens: int, budget_s: float, think_ms: float, seed: int
) -> tuple[Result, float]:
    """K client threads play the conversations, each one turn after turn with a pause (uniform in 0..2x
    ``think_ms``) before every turn but the first; returns the result and wall seconds."""
    todo: queue.Queue = queue.Queue()
    for c in convs:
        todo.put(c)
    result = Result()
    lock = threading.Lock()
    stop_at = time.monotonic() + budget_s

    def client(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        while time.monotonic() < stop_at:
            try:
                salt, turns = todo.get_nowait()
            except queue.Empty:
                return
            history: list[dict] = []
            for new in turns:
                if history:
                    time.sleep(rng.uniform(0, 2 * think_ms) / 1000)  # the user reads, then types
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

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return result, time.perf_counter() - t0


def warm_up(url: str, model: str, replicas: int, timeout_s: float = 120.0) -> None:
    """Requests in a tenant of their own until every replica has served one (the router learns of replicas a
    little after they are up), so that neither first-call costs nor a half-known cluster enter the figures."""
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    deadline = time.monotonic() + timeout_s
    i = 0
    while True:
        api.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"warm up {i}"}],
            max_tokens=2,
            extra_body={"cache_salt": f"warm-up-{i}"},
        )
        i += 1
        served = replica_series(url, "prefixcache_cache_lookups_total")
        if (i >= 4 and sum(n > 0 for n in served.values()) >= replicas) or time.monotonic() > deadline:
            return
        time.sleep(0.2)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(url: str, pid: int | None, args: argparse.Namespace, convs: list, think_ms: float) -> dict:
    """One round of load on one server: its figures."""
    before, cpu0 = counters(url), cpu_seconds(pid) if pid else None
    result, wall = play(url, args.model, convs, args.clients, args.max_tokens, args.budget_s, think_ms, args.seed)
    after, cpu1 = counters(url), cpu_seconds(pid) if pid else None

    def delta(name: str) -> dict[str, float]:
        return {r: v - before[name].get(r, 0.0) for r, v in after[name].items()}

    batches = sum(delta("prefixcache_batches_total").values())  # the batched-generate fallback
    rows = sum(delta("prefixcache_batch_rows_total").values())
    if not batches:  # the engine: requests per step
        batches = sum(delta("prefixcache_engine_steps_total").values())
        rows = sum(delta("prefixcache_engine_step_requests_total").values())
    return {
        "requests": result.requests,
        "errors": result.errors,
        "wall_s": wall,
        "requests_per_s": result.requests / wall if wall else 0.0,
        "token_hit_rate": result.cached_tokens / result.prompt_tokens if result.prompt_tokens else 0.0,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "ttft_p50_ms": 1000 * pct(result.ttft, 0.5),
        "ttft_p99_ms": 1000 * pct(result.ttft, 0.99),
        "requests_per_replica": delta("prefixcache_cache_lookups_total"),
        "mean_batch_size": rows / batches if batches else None,
        "server_cpu_ms_per_request": None if cpu0 is None else 1000 * (cpu1 - cpu0) / max(1, result.requests),
    }


def run_group(runs: list[Run], args: argparse.Namespace, logdir: Path) -> dict[str, list[dict]]:
    """Start the group's servers together, then play round after round on each in turn (fresh conversations
    every round, so drifting machine load hits every set-up of the group alike)."""
    rounds: dict[str, list[dict]] = {run.key: [] for run in runs}
    with ExitStack() as stack:
        live = {}
        for run in runs:
            s = run.setup
            pool = run.pool_factor * args.replica_cache_tokens
            cli = [
                *s.args,
                "--model",
                args.model,
                "--max-cached-tokens",
                str(pool),
                "--batch-wait-ms",
                str(args.batch_wait_ms),
            ]
            log = logdir / f"server_{run.key}_{run.phase}.log"
            url, pid = stack.enter_context(server(cli, log, args.startup_s))
            replicas = int(s.args[s.args.index("--replicas") + 1]) if "--replicas" in s.args else 1
            warm_up(url, args.model, replicas)
            live[run.key] = (url, None if replicas > 1 else pid)
        for r in range(args.rounds):
            convs = conversations(args, args.seed + r)
            for run in runs:
                rounds[run.key].append(measure(*live[run.key], args, convs, run.think_ms))
    return rounds


def plan(args: argparse.Namespace) -> list[list[Run]]:
    """Groups of runs: the throughput pair side by side, then the routing phase one server at a time."""
    chosen = set(args.setups)
    # throughput: pools that hold every chat, so that both servers serve the same hits and only batching differs
    groups = [[Run(k, SETUPS[k], 0.0, "throughput", 8) for k in "ab" if k in chosen]]
    if chosen & {"c", "d"}:
        if "b" in chosen:
            groups.append([Run("b'", SETUPS["b"], args.think_ms, "routing", 2)])
        groups += [[Run(k, SETUPS[k], args.think_ms, "routing", SETUPS[k].pool_factor)] for k in "cd" if k in chosen]
    return [g for g in groups if g]


def summarize(run: Run, rounds: list[dict], args: argparse.Namespace) -> dict:
    """Medians over rounds (requests and per-replica counts summed)."""

    def median(key: str) -> float | None:
        values = [r[key] for r in rounds if r[key] is not None]
        return statistics.median(values) if values else None

    per_replica: dict[str, float] = {}
    for r in rounds:
        for replica, n in r["requests_per_replica"].items():
            per_replica[replica] = per_replica.get(replica, 0.0) + n
    counts = sorted(per_replica.values())
    keys = ("wall_s", "requests_per_s", "token_hit_rate", "ttft_p50_ms", "ttft_p99_ms", "mean_batch_size")
    return {
        "row": run.key,
        "setup": run.setup.key,
        "label": run.setup.label,
        "phase": run.phase,
        "think_ms": run.think_ms,
        "pool_tokens_per_process": run.pool_factor * args.replica_cache_tokens,
        "rounds": rounds,
        "requests": sum(r["requests"] for r in rounds),
        "errors": sum(r["errors"] for r in rounds),
        **{k: median(k) for k in (*keys, "server_cpu_ms_per_request")},
        "requests_per_replica": counts,
        "max_over_min": (counts[-1] / counts[0]) if counts and counts[0] else None,
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
    if {"b'", "d"} <= rows.keys():
        r = rows["d"]["token_hit_rate"] / max(rows["b'"]["token_hit_rate"], 1e-9)
        out.append(("(d)/(b') token hit rate (one process, same total cache)", r, 0.9, r >= 0.9))
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
    ap.add_argument("--users", type=int, default=16, help="conversations per round")
    ap.add_argument("--turns", type=int, default=8, help="turns per conversation")
    ap.add_argument("--system-tokens", type=int, default=100, help="system prompt length (byte tokens)")
    ap.add_argument("--user-tokens", type=int, default=100, help="user message length (byte tokens)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per turn")
    ap.add_argument("--think-ms", type=float, default=1000.0, help="routing phase: mean pause before a turn")
    ap.add_argument(
        "--batch-wait-ms",
        type=float,
        default=20.0,
        help="every server's --batch-wait-ms (20: the clients of a batch that just ended come back 10-20 ms later "
        "on these cores, and join the next batch)",
    )
    ap.add_argument(
        "--replica-cache-tokens",
        type=int,
        default=4096,
        help="P: pool per Ray replica, in tokens (default: about half the chats in flight, where routing matters)",
    )
    ap.add_argument("--budget-s", type=float, default=300.0, help="time limit of one set-up's load")
    ap.add_argument("--startup-s", type=float, default=300.0, help="time limit of one server's start")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of load per set-up (fresh chats each round)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the results as JSON")
    args = ap.parse_args()
    meta = _meta.begin(peers=("ray",))
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
        for group in plan(args):
            results = run_group(group, args, Path(tmp))
            for run in group:
                rows[run.key] = summarize(run, results[run.key], args)

    table = Table(
        title=f"serve: {args.clients} clients; per round {args.users} chats x {args.turns} turns, {args.tenants} "
        f"tenants, {args.max_tokens}-token replies; model {args.model}; P = {args.replica_cache_tokens} tokens; "
        f"medians of {args.rounds} rounds"
    )
    cols = ("set-up", "think ms", "pool/proc", "requests", "req/s", "token hit", "TTFT p50 ms", "TTFT p99 ms", "batch")
    for col in (*cols, "server CPU ms/req", "per replica", "max/min"):
        table.add_column(col, justify="left" if col == "set-up" else "right")

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for r in rows.values():
        table.add_row(
            f"({r['row']}) {r['label']}",
            f"{r['think_ms']:.0f}",
            f"{r['pool_tokens_per_process']:,}",
            f"{r['requests']}" + (f" ({r['errors']} err)" if r["errors"] else ""),
            num(r["requests_per_s"], ".2f"),
            num(r["token_hit_rate"], ".3f"),
            num(r["ttft_p50_ms"], ".0f"),
            num(r["ttft_p99_ms"], ".0f"),
            num(r["mean_batch_size"], ".1f"),
            num(r["server_cpu_ms_per_request"], ".1f"),
            "/".join(f"{n:.0f}" for n in r["requests_per_replica"]),
            num(r["max_over_min"], ".2f"),
        )
    console = Console() if Console().is_terminal else Console(width=150)
    console.print(table)
    checks = targets(rows)
    for what, value, target, met in checks:
        op = "<=" if "max/min" in what else ">="
        console.print(f"{what}: {value:.2f} (target {op} {target}) {'OK' if met else 'MISSED'}")
    if args.json:
        payload = {"meta": _meta.end(meta), "args": vars(args) | {"json": str(args.json)}, "rows": list(rows.values())}
        payload["targets"] = [{"what": w, "value": v, "target": t, "met": m} for w, v, t, m in checks]
        args.json.write_text(json.dumps(payload, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
