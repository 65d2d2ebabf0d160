"""A hybrid model (recurrent layers beside attention) through prefixcache: time to first token on a cached prefix,
exactness, what its cache costs per token, and a chat replay beside a pure-attention model of the same size.

    python benchmarks/bench_hybrid.py [--model small-hybrid] [--reference small] [--prefix 2048] [--suffix 64]
                                      [--repeats 5] [--replay scenarios/chat.yaml] [--json FILE]

- TTFT (``max_new_tokens=1``, interleaved, medians over ``--repeats`` requests of prefix + a never-seen suffix):
  uncached ``model.generate``; ``PrefixCachedModel.generate`` on a hit (the prefix was sent once with its end as a
  snapshot hint, as ``serve`` does at a chat's system prompt); and the second sighting without any hint (the first
  request that shares the prefix, which finds its KV but no state there, recomputes it and keeps the state where
  they part: the third is a hit), for the record.
- Exactness: greedy tokens of every timed hit equal the bare model's; the first step's logits' largest difference
  (relative to their scale).
- Memory: one recurrent-state snapshot's bytes; KV bytes per token of the hybrid and of ``--reference``; bytes per
  cached token of the prefix (its KV plus the snapshots held) against the reference's KV per token.
- ``--replay SCENARIO``: ``prefixcache replay`` of the scenario on both models (hit rates, outputs checked).
- ``--serve-peers [PATH]`` (PATH defaults to ``benchmarks/serve_peers.py``): its multi-turn chat through
  ``prefixcache serve`` on both models (``--serve-rounds``): hit rates as ``serve`` reports them, replies against the
  bare model.
- ``--families``: the exactness probe of every hybrid family's tiny random model (``tests/hybrid_testutil.py``): a
  prompt's logits from one forward against two chunks, the second from the saved state, as multi-token chunks and
  one token at a time, float32 and bfloat16; which way the model is run (``tokenwise``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _meta
from engine import PrefixCachedModel
from engine.models import load_model
from engine.replay import TTFTStreamer


def _ttft(fn: Any, ids: torch.Tensor, **kw: Any) -> tuple[float, Any]:
    streamer = TTFTStreamer()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = fn(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=1,
            do_sample=False,
            streamer=streamer,
            output_scores=True,
            return_dict_in_generate=True,
            **kw,
        )
    assert streamer.first is not None
    return streamer.first - t0, out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def ttft(args: argparse.Namespace) -> dict[str, Any]:
    model, _ = load_model(args.model)
    pcm = PrefixCachedModel(model, max_cached_tokens=4 * (args.prefix + args.suffix), block_size=16)
    hy = pcm.runtime.hybrid
    assert hy is not None, f"{args.model} is not a hybrid model"
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 256, (args.prefix,), generator=gen).tolist()

    def prompt() -> torch.Tensor:
        return torch.tensor([prefix + torch.randint(0, 256, (args.suffix,), generator=gen).tolist()])

    _ttft(model.generate, prompt())  # warm-up of both paths (allocations, first calls)
    _ttft(pcm.generate, prompt(), snapshot_hints=[args.prefix])
    uncached, cached, diffs, same = [], [], [], []
    for _ in range(args.repeats):
        ids = prompt()
        t_ref, ref = _ttft(model.generate, ids)
        t_hit, out = _ttft(pcm.generate, ids)
        assert pcm.last_request_stats[0].cached_tokens == args.prefix, pcm.last_request_stats
        uncached.append(t_ref)
        cached.append(t_hit)
        diffs.append(_rel(out.scores[0], ref.scores[0]))
        same.append(bool(torch.equal(out.sequences, ref.sequences)))
    # the second sighting of a prefix nobody hinted: a fresh cache, one request, then the timed one
    fresh = PrefixCachedModel(model, max_cached_tokens=4 * (args.prefix + args.suffix), block_size=16)
    _ttft(fresh.generate, prompt())
    t_second, _ = _ttft(fresh.generate, prompt())
    second_cached = fresh.last_request_stats[0].cached_tokens
    t_third, _ = _ttft(fresh.generate, prompt())
    third_cached = fresh.last_request_stats[0].cached_tokens
    u, c = statistics.median(uncached), statistics.median(cached)
    return {
        "model": args.model,
        "params": sum(p.numel() for p in model.parameters()),
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "tokenwise": hy.tokenwise,
        "ttft_uncached_s": u,
        "ttft_cached_s": c,
        "ttft_ratio": c / u,
        "uncached_s": uncached,
        "cached_s": cached,
        "second_sighting": {"ttft_s": t_second, "cached_tokens": second_cached},
        "third_sighting": {"ttft_s": t_third, "cached_tokens": third_cached},
        "first_step_logits_max_rel_diff": max(diffs),
        "greedy_equal": all(same),
        "snapshots_held": len(hy.index),
        "state_bytes_per_snapshot": hy.spec.bytes_per_snapshot,
        "kv_bytes_per_token": pcm.runtime.kv_pool.nbytes // (pcm.runtime.kv_pool.num_blocks * 16),
    }


def memory(args: argparse.Namespace, hybrid: dict[str, Any]) -> dict[str, Any]:
    model, _ = load_model(args.reference)
    pcm = PrefixCachedModel(model, max_cached_tokens=1024, block_size=16)
    ref_kv = pcm.runtime.kv_pool.nbytes // (pcm.runtime.kv_pool.num_blocks * 16)
    ref_params = sum(p.numel() for p in model.parameters())
    kv, state, n = hybrid["kv_bytes_per_token"], hybrid["state_bytes_per_snapshot"], hybrid["prefix_tokens"]
    per_token = {k: (n * kv + k * state) / n for k in (1, 2)}  # the prefix's KV plus one or two snapshots on it
    return {
        "reference": args.reference,
        "reference_params": ref_params,
        "reference_kv_bytes_per_token": ref_kv,
        "hybrid_kv_bytes_per_token": kv,
        "state_bytes_per_snapshot": state,
        "snapshot_in_kv_tokens": state / kv,
        "hybrid_bytes_per_cached_token": per_token,
        "hybrid_over_reference": {k: v / ref_kv for k, v in per_token.items()},
    }


def replay_both(args: argparse.Namespace) -> dict[str, Any]:
    from engine.replay import replay
    from prefixcache.sim.policy import Capacity
    from prefixcache.workload.scenario import load_scenario

    scenario = load_scenario(Path(args.replay))
    out: dict[str, Any] = {"scenario": args.replay}
    for role, name in (("reference", args.reference), ("hybrid", args.model)):
        results, _ = replay(scenario, [Capacity(None)], model=name, block_size=16)
        t = results[0].totals()
        out[role] = {
            "model": name,
            "token_hit_rate": t["token_hit_rate"],
            "prompt_tokens": t["prompt_tokens"],
            "cached_tokens": t["cached_tokens"],
            "outputs_checked": t.get("outputs_checked"),
            "outputs_mismatched": t.get("outputs_mismatched"),
            "ttft_cached_p50_s": t.get("ttft_cached_p50_s"),
            "ttft_uncached_p50_s": t.get("ttft_uncached_p50_s"),
        }
    out["hit_rate_points_behind"] = 100 * (out["reference"]["token_hit_rate"] - out["hybrid"]["token_hit_rate"])
    return out


def serve_both(args: argparse.Namespace) -> dict[str, Any]:
    """``serve_peers.py`` (its chat workload, ``prefixcache serve`` alone) on both models, each saved to a folder
    under /tmp once: hit rates from the cached tokens ``serve`` reports, and the agreement prompts' replies against
    the bare model's greedy ones."""
    import subprocess

    from engine.models import load_model

    out: dict[str, Any] = {"rounds": args.serve_rounds}
    for role, name in (("reference", args.reference), ("hybrid", args.model)):
        folder = Path("/tmp/serve-peers") / f"{name}-model"
        if not (folder / "config.json").exists():
            model, tok = load_model(name)
            folder.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(folder)
            tok.save_pretrained(folder)
        result = Path("/tmp/serve-peers") / f"bench-hybrid-{name}.json"
        cmd = [sys.executable, args.serve_peers, "--project", str(Path(__file__).resolve().parents[1])]
        cmd += [
            "--servers",
            "pc",
            "--rounds",
            str(args.serve_rounds),
            "--model-dir",
            str(folder),
            "--json",
            str(result),
        ]
        subprocess.run(cmd, check=True)
        (s,) = [x for x in json.loads(result.read_text())["summary"] if x["phase"] == "closed"]
        vs_bare = s["agreement_prompts_vs_bare_hf"] or {}
        out[role] = {
            "model": name,
            "requests": s["requests"],
            "errors": s["errors"],
            "requests_per_s": s["requests_per_s_median"],
            "mean_prompt_tokens": s["mean_prompt_tokens"],
            "mean_cached_tokens": s["mean_cached_tokens"],
            "token_hit_rate": s["mean_cached_tokens"] / s["mean_prompt_tokens"],
            "agreement_vs_bare": vs_bare,
            "agreement_prompts": sum(vs_bare.values()),
            "agreement_equal": sum(n for how, n in vs_bare.items() if how != "DIFFERENT"),
        }
    out["hit_rate_points_behind"] = 100 * (out["reference"]["token_hit_rate"] - out["hybrid"]["token_hit_rate"])
    return out


def families() -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from hybrid_testutil import RECURRENT, build

    from engine.hybrid import probe, recurrent

    out: dict[str, Any] = {}
    for family in RECURRENT:
        row: dict[str, Any] = {}
        for dtype in (torch.float32, torch.bfloat16):
            model = build(family, dtype=dtype)
            spec = probe.probe_spec(model)
            modules = recurrent.find_modules(model, list(spec.layers))
            assert not isinstance(modules, str), modules
            recurrent.install(modules, tokenwise=True)
            name = str(dtype).removeprefix("torch.")
            row[name] = {
                "chunked": probe.chunked_difference(model, tokenwise=False),
                "tokenwise": probe.chunked_difference(model, tokenwise=True),
                "tolerance": probe.tolerance(model),
            }
        runtime = PrefixCachedModel(build(family), max_cached_tokens=256).runtime
        assert runtime.hybrid is not None
        row["runs_tokenwise"] = runtime.hybrid.tokenwise
        row["state_bytes_per_snapshot"] = runtime.hybrid.spec.bytes_per_snapshot
        out[family] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small-hybrid")
    ap.add_argument("--reference", default="small", help="a pure-attention model of about the same size")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--replay", default=None, help="a scenario to replay on both models (e.g. scenarios/chat.yaml)")
    ap.add_argument(
        "--serve-peers",
        nargs="?",
        const=str(Path(__file__).resolve().parent / "serve_peers.py"),
        default=None,
        help="serve_peers.py (default: benchmarks/serve_peers.py): its chat through `serve` on both models",
    )
    ap.add_argument("--serve-rounds", type=int, default=1)
    ap.add_argument("--families", action="store_true", help="probe every hybrid family's exactness (tiny models)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")
    meta = _meta.begin(peers=("transformers",))
    doc: dict[str, Any] = {"ttft": ttft(args)}
    doc["memory"] = memory(args, doc["ttft"])
    if args.replay:
        doc["replay"] = replay_both(args)
    if args.serve_peers:
        doc["serve"] = serve_both(args)
    if args.families:
        doc["families"] = families()
    t, m = doc["ttft"], doc["memory"]
    print(f"{t['model']} ({t['params'] / 1e6:.1f}M), {t['prefix_tokens']} cached + {t['suffix_tokens']} new tokens:")
    print(
        f"  TTFT uncached {t['ttft_uncached_s'] * 1000:,.0f} ms, hit {t['ttft_cached_s'] * 1000:,.0f} ms: "
        f"{t['ttft_ratio']:.3f}x (greedy equal: {t['greedy_equal']}, first-step logits max rel diff "
        f"{t['first_step_logits_max_rel_diff']:.1e})"
    )
    print(
        f"  second sighting without a hint: {t['second_sighting']['cached_tokens']} cached, "
        f"{t['second_sighting']['ttft_s'] * 1000:,.0f} ms; third: {t['third_sighting']['cached_tokens']} cached, "
        f"{t['third_sighting']['ttft_s'] * 1000:,.0f} ms"
    )
    print(
        f"  one snapshot {m['state_bytes_per_snapshot']:,} B (= the KV of {m['snapshot_in_kv_tokens']:.0f} tokens); "
        f"KV per token {m['hybrid_kv_bytes_per_token']:,} B vs {m['reference_kv_bytes_per_token']:,} B "
        f"({m['reference']}); per cached token with 1/2 snapshots: "
        f"{m['hybrid_over_reference'][1]:.3f}x / {m['hybrid_over_reference'][2]:.3f}x of {m['reference']}'s"
    )
    if "replay" in doc:
        r = doc["replay"]
        for x in (r["reference"], r["hybrid"]):
            print(
                f"  replay {r['scenario']} on {x['model']}: {x['token_hit_rate']:.1%} of prompt tokens cached, outputs "
                f"{x['outputs_checked'] - x['outputs_mismatched']}/{x['outputs_checked']} equal"
            )
    if "serve" in doc:
        for x in (doc["serve"]["reference"], doc["serve"]["hybrid"]):
            print(
                f"  serve_peers chat on {x['model']}: {x['token_hit_rate']:.1%} of prompt tokens cached over "
                f"{x['requests']} requests ({x['errors']} errors), {x['requests_per_s']:.2f} req/s; replies equal to "
                f"the bare model's {x['agreement_equal']}/{x['agreement_prompts']}"
            )
    for family, row in doc.get("families", {}).items():
        f32, b16 = row["float32"], row["bfloat16"]
        print(
            f"  {family:18s} float32 chunked {f32['chunked']:.1e} / token by token {f32['tokenwise']:.1e}; "
            f"bfloat16 {b16['chunked']:.1e} / {b16['tokenwise']:.1e}; runs {'token by token' if row['runs_tokenwise'] else 'chunked'}"
        )
    if args.json:
        doc["meta"] = _meta.end(meta)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
