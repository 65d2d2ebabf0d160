"""A soak of ``prefixcache serve`` under abuse: a bounded time of mixed, badly behaved clients against one process
(or ``--replicas 2``) on 127.0.0.1 at a free port, sampled every few seconds, then a SIGTERM under load.

    python benchmarks/soak.py --minutes 20                  # one process (the issue's target run)
    python benchmarks/soak.py --minutes 5 --replicas 2 --clients 6   # Ray Serve replicas
    python benchmarks/soak.py --minutes 1 --json /tmp/s.json   # a quick look

The server runs the ``tiny`` preset with a small pool (``--pool-tokens``, default 1,536: a burst of long prompts
needs several times it) and ``--max-queued-requests``. The clients (``--clients`` at once, each picking its next
action at random, seeded): multi-turn chats behind a few shared system prompts (greedy; every completed reply is
checked against the bare model at the end), streams closed after a few chunks, requests given up before their
first token, the same request retried, slow readers, bursts of prompts near the context length, prompts the pool
can never hold (400 expected), malformed bodies (400 expected) and unknown fields (ignored). Every
``--sample-s``: the server's RSS (its process tree), ``/debug/cache`` (each replica's free and pinned blocks and
``check_integrity()``), requests in flight, latency percentiles of the last window. At the end the load stops,
the pool must return to 0 pinned blocks, then a last wave is started and the server gets SIGTERM in the middle of
it: every request of that wave must end with a complete reply or a clean error within the drain timeout, and the
process must exit 0. Writes the JSON (``--json``) and a plot of RSS / pinned blocks / in flight over time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_peers import free_port, tree

import _meta

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "soak.json"
MODEL = "tiny"
SYSTEMS = [f"You are assistant {k} of the shop. " + "Answer briefly and politely. " * (6 + 4 * k) for k in range(3)]
ACTIONS = {  # action: weight
    "chat": 40,
    "stream_cut": 10,
    "give_up": 8,
    "retry": 6,
    "slow_reader": 6,
    "burst": 3,
    "never_fits": 3,
    "malformed": 4,
    "unknown_fields": 4,
}


def tree_rss(pid: int) -> int:
    """Bytes resident in ``pid`` and its descendants (Ray's replicas are children), from /proc."""
    total = 0
    for p in tree(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return total


class Soak:
    """The clients, their records, and the samples."""

    def __init__(self, url: str, args: argparse.Namespace, pid: int) -> None:
        self.url, self.args, self.pid = url, args, pid
        self.rng = random.Random(args.seed)
        self.chats: dict[int, list[dict[str, str]]] = {}
        self.replies: list[tuple[list[dict[str, str]], str, int]] = []  # messages, reply text, max_tokens
        self.status: dict[str, int] = {}
        self.unexpected: list[str] = []
        self.latencies: list[tuple[float, float]] = []  # (end time, seconds)
        self.samples: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    def count(self, what: str) -> None:
        self.status[what] = self.status.get(what, 0) + 1

    async def run(self, client: Any, until: float) -> None:
        names, weights = list(ACTIONS), list(ACTIONS.values())
        while time.monotonic() < until:
            action = self.rng.choices(names, weights)[0]
            try:
                await getattr(self, action)(client)
            except Exception as exc:  # a transport error the action did not expect
                self.count(f"{action}:error")
                self.unexpected.append(f"{action}: {type(exc).__name__}: {exc}"[:300])

    # ---- actions ---------------------------------------------------------------------------------------------
    def _turn(self) -> tuple[int, list[dict[str, str]]]:
        user = self.rng.randrange(self.args.users)
        history = self.chats.get(user)
        if history is None or len(history) > 8:
            history = [{"role": "system", "content": SYSTEMS[user % len(SYSTEMS)]}]
        msg = {"role": "user", "content": f"Question {self.rng.randrange(1000)} from user {user}?"}
        return user, [*history, msg]

    async def _post(self, client: Any, body: dict[str, Any], path: str = "/v1/chat/completions") -> Any:
        t = time.monotonic()
        r = await client.post(f"{self.url}{path}", json=body, timeout=120)
        self.count(str(r.status_code))
        if r.status_code >= 500:
            self.unexpected.append(f"{r.status_code}: {r.text[:200]}")
        if r.status_code == 200:
            self.latencies.append((time.monotonic(), time.monotonic() - t))
        return r

    async def chat(self, client: Any) -> None:
        user, messages = self._turn()
        n = self.rng.choice([4, 8, 16])
        r = await self._post(client, {"model": MODEL, "messages": messages, "max_tokens": n, "temperature": 0})
        if r.status_code == 200:
            text = r.json()["choices"][0]["message"]["content"]
            self.replies.append((messages, text, n))
            self.chats[user] = [*messages, {"role": "assistant", "content": text}]

    async def retry(self, client: Any) -> None:
        _, messages = self._turn()
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
        for _ in range(2):
            r = await self._post(client, body)
            if r.status_code == 200:
                self.replies.append((messages, r.json()["choices"][0]["message"]["content"], 8))

    async def stream_cut(self, client: Any) -> None:
        _, messages = self._turn()
        body = {"model": MODEL, "messages": messages, "max_tokens": 200, "temperature": 0, "stream": True}
        keep = self.rng.randrange(1, 6)
        async with client.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=120) as r:
            self.count(f"stream {r.status_code}")
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: {")
                if n >= keep:
                    break  # the client goes away mid-stream

    async def slow_reader(self, client: Any) -> None:
        _, messages = self._turn()
        body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0, "stream": True}
        async with client.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=120) as r:
            self.count(f"stream {r.status_code}")
            async for _line in r.aiter_lines():
                await asyncio.sleep(0.05)

    async def give_up(self, client: Any) -> None:
        import httpx

        _, messages = self._turn()
        body = {"model": MODEL, "messages": messages, "max_tokens": 64, "temperature": 0}
        try:
            await client.post(f"{self.url}/v1/chat/completions", json=body, timeout=0.02)
            self.count("give_up:answered")
        except httpx.TimeoutException:
            self.count("give_up")

    async def burst(self, client: Any) -> None:
        n, length = self.args.burst, self.args.long_tokens
        prompts = [[self.rng.randrange(32, 127) for _ in range(length)] for _ in range(n)]
        bodies = [{"model": MODEL, "prompt": p, "max_tokens": 32, "temperature": 0} for p in prompts]
        await asyncio.gather(*(self._post(client, b, "/v1/completions") for b in bodies))

    async def never_fits(self, client: Any) -> None:
        prompt = [65] * (self.args.pool_tokens + 8)
        r = await self._post(client, {"model": MODEL, "prompt": prompt[:2000], "max_tokens": 40}, "/v1/completions")
        if r.status_code != 400:
            self.unexpected.append(f"never_fits answered {r.status_code}")

    async def malformed(self, client: Any) -> None:
        bad = self.rng.choice(['{"model": "tiny", "messages": [', "not json", '{"model": "tiny"}', "[]"])
        r = await client.post(f"{self.url}/v1/chat/completions", content=bad, timeout=60)
        self.count(f"malformed {r.status_code}")
        if r.status_code != 400:
            self.unexpected.append(f"malformed body answered {r.status_code}")

    async def unknown_fields(self, client: Any) -> None:
        _, messages = self._turn()
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, "frobnicate": {"x": 1}}
        await self._post(client, body)

    # ---- sampling --------------------------------------------------------------------------------------------
    async def sample(self, client: Any) -> dict[str, Any]:
        now = time.monotonic()
        got = await client.get(f"{self.url}/debug/cache", timeout=120)
        debug = got.json() if got.status_code == 200 else {"in_flight": -1, "replicas": {}}
        if got.status_code != 200:  # counted: a sample without figures fails "integrity at every sample"
            self.unexpected.append(f"/debug/cache answered {got.status_code}: {got.text[:200]}")
        reps = debug["replicas"]
        window = [s for t, s in self.latencies if t > now - self.args.sample_s]
        row = {
            "t_s": now - self.t0,
            "rss_bytes": tree_rss(self.pid),
            "in_flight": debug["in_flight"],
            "pinned_blocks": sum(r.get("pinned_blocks", 0) + r.get("owned_blocks", 0) for r in reps.values()),
            "free_blocks": sum(r.get("free_blocks", 0) for r in reps.values()),
            "queue_length": sum(r.get("queue_length", 0) for r in reps.values()),
            "integrity_ok": all(r.get("integrity") == "ok" for r in reps.values()) and bool(reps),
            "p50_s": statistics.median(window) if window else None,
            "p99_s": sorted(window)[int(0.99 * (len(window) - 1))] if window else None,
            "completed": len(self.latencies),
        }
        self.samples.append(row)
        return row


async def load(soak: Soak, args: argparse.Namespace) -> None:
    import httpx

    limits = httpx.Limits(max_connections=args.clients * 4)
    async with httpx.AsyncClient(limits=limits) as client:
        until = time.monotonic() + args.minutes * 60
        tasks = [asyncio.create_task(soak.run(client, until)) for _ in range(args.clients)]
        while time.monotonic() < until:
            await asyncio.sleep(args.sample_s)
            row = await soak.sample(client)
            print(
                f"{row['t_s']:7.0f} s  rss {row['rss_bytes'] / 2**20:7.1f} MiB  in flight {row['in_flight']:3d}  "
                f"pinned {row['pinned_blocks']:4d}  integrity {'ok' if row['integrity_ok'] else 'BROKEN'}  "
                f"done {row['completed']}",
                flush=True,
            )
        await asyncio.gather(*tasks)
        deadline = time.monotonic() + 60
        while True:  # the load is over: nothing may stay pinned
            row = await soak.sample(client)
            if (row["in_flight"] == 0 and row["pinned_blocks"] == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)


async def sigterm_wave(url: str, proc: subprocess.Popen[bytes], n: int, drain: int) -> dict[str, Any]:
    """``n`` chat requests at once, SIGTERM once they run; how each ended and how the process exited."""
    import httpx

    async def one(client: Any, k: int) -> str:
        body = {
            "model": MODEL,
            "messages": [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": f"last {k}"}],
            "max_tokens": 300,
            "temperature": 0,
        }
        try:
            r = await client.post(f"{url}/v1/chat/completions", json=body, timeout=drain + 60)
            return "complete" if r.status_code == 200 and r.json()["choices"] else f"status {r.status_code}"
        except httpx.HTTPError as exc:
            return f"clean error ({type(exc).__name__})"

    async with httpx.AsyncClient() as client:
        tasks = [asyncio.create_task(one(client, k)) for k in range(n)]
        await asyncio.sleep(1.0)  # they run (300 tokens each take longer)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        outcomes = await asyncio.gather(*tasks)
        ended_s = time.monotonic() - t0
    try:
        code = proc.wait(timeout=drain + 120)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    return {
        "requests": n,
        "outcomes": {o: outcomes.count(o) for o in set(outcomes)},
        "exit_code": code,
        "ended_within_s": ended_s,
        "drain_timeout_s": drain,
    }


def check_replies(replies: list[tuple[list[dict[str, str]], str, int]]) -> dict[str, int]:
    """Every completed greedy chat reply against the bare model's for its messages (deduplicated)."""
    import torch

    from engine.models import build_preset

    model, tok = build_preset(MODEL)
    seen: dict[str, str] = {}
    mismatched = 0
    for messages, text, n in replies:
        key = json.dumps([messages, n])
        if key not in seen:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_tensors="pt")
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
            seen[key] = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        mismatched += seen[key] != text
    return {"checked": len(replies), "distinct": len(seen), "mismatched": mismatched}


def plot(samples: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(8, 6), sharex=True)
    axes[0].plot(t, [s["rss_bytes"] / 2**20 for s in samples])
    axes[0].set_ylabel("RSS (MiB)")
    axes[1].plot(t, [s["pinned_blocks"] for s in samples])
    axes[1].set_ylabel("pinned blocks")
    axes[2].plot(t, [s["in_flight"] for s in samples])
    axes[2].set_ylabel("in flight")
    axes[2].set_xlabel("minutes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The figures docs/serving.md shows, derived from the run's counts (added to ``result`` and returned)."""
    counts = result["status_counts"]
    outcomes = result["sigterm"]["outcomes"]
    result["summary"] = {
        "answered": result["final"]["completed"],
        "queue_full_429": counts.get("429", 0) + counts.get("stream 429", 0),
        "bad_400": counts.get("400", 0) + counts.get("malformed 400", 0),
        "sigterm_complete": outcomes.get("complete", 0),
        "sigterm_errors": sum(v for k, v in outcomes.items() if k != "complete"),
        "sigterm_error_kinds": ", ".join(sorted(k for k in outcomes if k != "complete")) or "none",
        "clients": result["settings"]["clients"],
    }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--users", type=int, default=24)
    ap.add_argument("--pool-tokens", type=int, default=1536)
    ap.add_argument("--long-tokens", type=int, default=1400, help="a burst's prompts (tiny's context: 2,048)")
    ap.add_argument("--burst", type=int, default=6)
    ap.add_argument("--max-queued", type=int, default=48)
    ap.add_argument("--drain-timeout", type=int, default=20)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="default benchmarks/results/soak[_replicas].json")
    ap.add_argument("--resummarize", type=Path, default=None, help="recompute a written JSON's summary and exit")
    args = ap.parse_args()
    if args.resummarize is not None:
        done = summarize(json.loads(args.resummarize.read_text()))
        args.resummarize.write_text(json.dumps(done, indent=1) + "\n")
        print(json.dumps(done["summary"], indent=1))
        return
    out = args.json or OUT.with_name("soak.json" if args.replicas == 1 else "soak_replicas.json")
    meta = _meta.begin()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "prefixcache", "serve", "--model", MODEL, "--port", str(port)]
    cmd += ["--max-cached-tokens", str(args.pool_tokens), "--debug-endpoints", "--max-queued-requests"]
    cmd += [str(args.max_queued), "--drain-timeout", str(args.drain_timeout), "--default-max-tokens", "16"]
    if args.replicas > 1:
        cmd += ["--replicas", str(args.replicas)]
    log = out.with_suffix(".log")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    import httpx

    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the server did not come up; see {log}")
        time.sleep(0.5)
    soak = Soak(url, args, proc.pid)
    try:
        asyncio.run(load(soak, args))
        wave = asyncio.run(sigterm_wave(url, proc, 2 * args.clients, args.drain_timeout))
    finally:
        if proc.poll() is None:
            proc.kill()
    replies = check_replies(soak.replies)
    s = soak.samples
    last15 = [x for x in s if x["t_s"] >= s[-1]["t_s"] - 15 * 60]
    first = last15[0]["rss_bytes"] if last15 else 0
    result = {
        "minutes": args.minutes,
        "replicas": args.replicas,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "samples": s,
        "status_counts": soak.status,
        "unexpected": soak.unexpected[:50],
        "unexpected_count": len(soak.unexpected),
        "server_errors_5xx": sum(v for k, v in soak.status.items() if k[:1] == "5" or k.startswith("stream 5")),
        "integrity_ok_every_sample": all(x["integrity_ok"] for x in s),
        "final": s[-1],
        "rss_growth_last_15_min": (s[-1]["rss_bytes"] - first) / first if first else None,
        "rss_window_minutes": (s[-1]["t_s"] - last15[0]["t_s"]) / 60 if last15 else 0,
        "replies": replies,
        "sigterm": wave,
    }
    result["meta"] = _meta.end(meta)
    out.write_text(json.dumps(summarize(result), indent=1) + "\n")
    plot(s, out.with_suffix(".png"), f"prefixcache serve soak: {args.minutes:g} min, {args.replicas} replica(s)")
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "settings", "meta")}, indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
