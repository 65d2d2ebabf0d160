"""lm-evaluation-harness through prefixcache (``--model prefixcache``) against lm-eval's ``--model hf``, side by side
in one process, on three local tasks built here (seeded, nothing downloaded) for the built-in ``small`` model:

(a) ``mc_sampled``: 5-shot multiple choice, ``--items`` questions x 4 choices, each question's exemplars drawn
    from a 200-question train split by lm-eval's default sampler (different exemplars per item);
(b) ``mc_shared``: the same questions, the same 5 exemplars for every item (``fewshot_config: sampler: first_n``);
(c) ``short_answer``: 3-shot short answers (``generate_until``, the same exemplars for every item, ``--items / 2``
    questions (at least 2), at most ``--max-gen-toks`` tokens, stopping at a newline).

Text is sized like real benchmarks: with the byte tokenizer a multiple-choice request is 800-900 tokens (a
description, five exemplars of a ~100-character question and its answer, the question, one of four answers).

Per task: accuracy (both), the largest |log-likelihood difference| over all requests and whether every is_greedy
flag matched, whether the generations are identical (c), seconds inside the model's request methods
(``loglikelihood`` / ``generate_until``: lm-eval's own task building and metrics excluded; the whole
``simple_evaluate`` is in the JSON) and the ratio, the tokens hf feeds (the sum of each request's input length:
``len(context) + len(continuation) - 1`` for a score, the prompt for a generation), the avoidable-token bound of a
perfect token-granular prefix cache (for each request in the order prefixcache runs them, the longest common prefix
with any earlier request's sequence, capped at ``len(context) - 1``), the bound on the speed-up it implies
(fed / (fed - avoidable)), and the prefill tokens prefixcache computed: the engine's ``prefill_tokens`` for scores,
``prompt - cached`` tokens of each ``generate`` call (its RowStats) for generations; and their ratio to the
unavoidable tokens (fed - avoidable). The cache is reset before each task; each model first scores one short
request outside the timings (prefixcache builds its engine then: a few seconds, reported as set-up).

Targets (on a quiet machine): (a) <= 0.35x hf's time, (b) <= 0.1x, (c) identical generations and <= 0.7x; computed
prefill within 1.15x of the unavoidable tokens.

    python benchmarks/bench_lm_eval.py [--items 100] [--tasks abc] [--models hf,prefixcache] [--block-size 4]
        [--max-cached-tokens 32768] [--max-gen-toks 10] [--batch-size 1] [--model small] [--threads N] [--json FILE]
    python benchmarks/bench_lm_eval.py --items 3    # smoke run

The whole run is long: hf computes about 380k tokens for each multiple-choice task (about 25 minutes each at the
~250 tokens/s the ``small`` model prefills on 2 CPU cores); prefixcache about a tenth of that in all.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import _meta

TASKS = {"a": "mc_sampled", "b": "mc_shared", "c": "short_answer"}
TARGETS = {"mc_sampled": 0.35, "mc_shared": 0.1, "short_answer": 0.7}
PREFILL_TARGET = 1.15
VOCABULARY = (  # the words of the generated text
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they you "
    "were her she there one all we their can has been if more when will would who so no time river energy market "
    "water system light power number people history city country school music field animal plant metal heat "
    "earth forest ocean island mountain valley village bridge engine signal theory method result cell protein "
    "star planet orbit climate trade law court army king queen church language novel poem painting temple "
    "harbor railway factory salt iron copper glass paper cotton wheat rice coffee sugar winter summer storm"
)
WORDS = VOCABULARY.split()


# ---- the tasks -----------------------------------------------------------------------------------------------
def _text(rnd: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rnd.choice(WORDS))
    return " ".join(words).capitalize()


def _mc_doc(rnd: random.Random) -> dict[str, Any]:
    return {
        "question": _text(rnd, rnd.randint(85, 115)) + "?",
        "choices": [_text(rnd, rnd.randint(12, 30)).lower() for _ in range(4)],
        "answer": rnd.randrange(4),
    }


def _qa_doc(rnd: random.Random) -> dict[str, Any]:
    return {"question": _text(rnd, rnd.randint(85, 115)) + "?", "answer": _text(rnd, rnd.randint(5, 15)).lower()}


def build_tasks(folder: Path, items: int, gen_items: int, max_gen_toks: int, seed: int) -> None:
    """Write the three tasks' data (jsonl) and lm-eval configs (yaml) into ``folder``."""
    rnd = random.Random(seed)
    data = {
        "mc_train": [_mc_doc(rnd) for _ in range(200)],
        "mc_test": [_mc_doc(rnd) for _ in range(items)],
        "qa_train": [_qa_doc(rnd) for _ in range(3)],
        "qa_test": [_qa_doc(rnd) for _ in range(gen_items)],
    }
    for name, rows in data.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = folder / "hf_datasets"
    mc = f"""dataset_path: json
dataset_kwargs:
  data_files: {{train: {folder}/mc_train.jsonl, test: {folder}/mc_test.jsonl}}
  cache_dir: {cache}
output_type: multiple_choice
training_split: train
fewshot_split: train
test_split: test
num_fewshot: 5
description: "The following are multiple choice questions (with answers) about general knowledge.\\n\\n"
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
    (folder / "mc_sampled.yaml").write_text("task: mc_sampled\n" + mc)
    (folder / "mc_shared.yaml").write_text("task: mc_shared\n" + mc + "fewshot_config:\n  sampler: first_n\n")
    (folder / "short_answer.yaml").write_text(
        f"""task: short_answer
dataset_path: json
dataset_kwargs:
  data_files: {{train: {folder}/qa_train.jsonl, test: {folder}/qa_test.jsonl}}
  cache_dir: {cache}
output_type: generate_until
training_split: train
fewshot_split: train
test_split: test
num_fewshot: 3
fewshot_config:
  sampler: first_n
description: "Answer each question in a few words.\\n\\n"
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
    )


# ---- what the model is asked, and how long it takes ----------------------------------------------------------
@dataclass
class Probe:
    """Instruments an lm-eval LM instance: seconds inside its request methods, the (context, continuation) token
    lists it scores, and every generate call's prompts and outputs (and, through PrefixCachedModel, its RowStats)."""

    lm: Any
    model_s: float = 0.0
    pairs: list[tuple[list[int], list[int]]] = field(default_factory=list)
    generations: list[tuple[list[int], list[int]]] = field(default_factory=list)
    rows: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        lm = self.lm
        for name in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
            setattr(lm, name, self._timed(getattr(lm, name)))
        tokens = lm._loglikelihood_tokens

        def scored(requests, disable_tqdm=False, override_bs=None):
            self.pairs.extend((list(ctx), list(cont)) for _, ctx, cont in requests)
            return tokens(requests, disable_tqdm, override_bs)

        lm._loglikelihood_tokens = scored
        model = lm.model
        generate = model.generate

        def generated(*args, **kwargs):
            out = generate(*args, **kwargs)
            ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
            seqs = out if isinstance(out, torch.Tensor) else out.sequences
            for r in range(ids.shape[0]):
                pad = 0 if mask is None else int((mask[r] == 0).sum())
                self.generations.append((ids[r, pad:].tolist(), seqs[r, ids.shape[1] :].tolist()))
            self.rows.extend(getattr(model, "last_request_stats", ()))
            return out

        model.generate = generated

    def _timed(self, method):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.model_s += time.perf_counter() - start

        return run

    def reset(self) -> None:
        self.model_s = 0.0
        self.pairs, self.generations, self.rows = [], [], []


def avoidable(requests: list[tuple[list[int], int, list[int]]]) -> int:
    """A perfect token-granular prefix cache: for each (query, cap, sequence) in order, the longest prefix of
    ``query`` that some earlier request's ``sequence`` starts with, at most ``cap``; summed. The sequences go into a
    token trie as they come (edges keyed by (node, token))."""
    edges: dict[tuple[int, int], int] = {}
    total = 0
    for query, cap, seq in requests:
        node = depth = 0
        for tok in query:
            child = edges.get((node, tok))
            if child is None:
                break
            node, depth = child, depth + 1
        total += min(depth, cap)
        node = 0
        for tok in seq:
            child = edges.get((node, tok))
            if child is None:
                child = edges[(node, tok)] = len(edges) + 1
            node = child
    return total


def score_bound(pairs: list[tuple[list[int], list[int]]], max_length: int) -> tuple[int, int]:
    """(tokens fed, avoidable tokens) of scoring ``pairs`` as hf does (window ``(ctx + cont)[-(max_length + 1):]``,
    all but its last token through the model), in prefixcache's order (token-sequence order)."""
    windows = [((c + k)[-(max_length + 1) :], len(k)) for c, k in pairs]
    windows.sort(key=lambda w: w[0])
    fed = sum(len(w) - 1 for w, _ in windows)
    return fed, avoidable([(w, len(w) - n - 1, w) for w, n in windows])


def generation_bound(generations: list[tuple[list[int], list[int]]]) -> tuple[int, int]:
    """(prompt tokens fed, avoidable prompt tokens) of the generate calls in their order; each prompt's output
    is cached with it."""
    fed = sum(len(p) for p, _ in generations)
    return fed, avoidable([(p, len(p) - 1, p + out) for p, out in generations])


def warm_up(lm: Any) -> float:
    """Score one short request (prefixcache: the engine is built, its C kernel compiled on first use and its
    linears packed; hf: the first forward), outside the timings; returns its seconds."""
    start = time.perf_counter()
    lm._loglikelihood_tokens([(None, [lm.prefix_token_id, *range(40, 104)], [65, 66, 67])])
    return time.perf_counter() - start


# ---- one task through one model ------------------------------------------------------------------------------
def run_task(lm: Any, probe: Probe, task: str, folder: Path) -> dict[str, Any]:
    """Evaluate ``task`` with ``lm`` (cache reset first); results, samples, timings and what was computed."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    pcm = getattr(lm, "prefix_cached", None)
    if pcm is not None:
        pcm.reset_cache()
        engine = pcm.engine()
        before = dict(vars(engine.stats)) if engine is not None else {}
        evicted = pcm.cache_stats()["blocks_evicted"]
    probe.reset()
    tm = TaskManager(include_path=str(folder), include_defaults=False)
    start = time.perf_counter()
    res = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tm, log_samples=True)
    out: dict[str, Any] = {
        "results": res["results"][task],
        "samples": res["samples"][task],
        "model_s": probe.model_s,
        "evaluate_s": time.perf_counter() - start,
        "pairs": probe.pairs,
        "generations": probe.generations,
    }
    if pcm is not None:
        if probe.pairs:  # scoring runs on the engine: what it computed
            after = vars(pcm.engine().stats)
            out["computed_prefill"] = after["prefill_tokens"] - before.get("prefill_tokens", 0)
            out["computed_source"] = "engine stats: prefill_tokens"
            out["engine_steps"] = after["steps"] - before.get("steps", 0)
        else:  # generate: each call's prompt tokens not served from cache
            out["computed_prefill"] = sum(r.prompt_tokens - r.cached_tokens for r in probe.rows)
            out["computed_source"] = "generate RowStats: prompt - cached tokens"
        out["blocks_evicted"] = pcm.cache_stats()["blocks_evicted"] - evicted
    return out


def compare(task: str, runs: dict[str, dict[str, Any]], max_length: int) -> dict[str, Any]:
    """One row of the table from the runs of ``task`` by each model."""
    hf, pc = runs.get("hf"), runs.get("prefixcache")
    any_run = hf or pc
    assert any_run is not None
    metric = "acc,none" if "acc,none" in any_run["results"] else "exact_match,none"
    row: dict[str, Any] = {"task": task, "items": len(any_run["samples"]), "metric": metric.split(",")[0]}
    for name, run in runs.items():
        row[f"{name}_score"] = run["results"][metric]
        row[f"{name}_model_s"] = run["model_s"]
        row[f"{name}_evaluate_s"] = run["evaluate_s"]
    if any_run["pairs"]:
        row["requests"] = len(any_run["pairs"])
        row["fed"], row["avoidable"] = score_bound(any_run["pairs"], max_length)
    else:
        row["requests"] = len(any_run["generations"])
        row["fed"], row["avoidable"] = generation_bound(any_run["generations"])
    row["unavoidable"] = row["fed"] - row["avoidable"]
    row["speedup_bound"] = row["fed"] / max(row["unavoidable"], 1)
    if pc is not None:
        row["computed_prefill"] = pc.get("computed_prefill")
        row["computed_source"] = pc.get("computed_source")
        row["computed_over_unavoidable"] = (pc.get("computed_prefill") or 0) / max(row["unavoidable"], 1)
        row["blocks_evicted"] = pc.get("blocks_evicted")
    if hf is not None and pc is not None:
        row["time_ratio"] = pc["model_s"] / hf["model_s"]
        row["evaluate_ratio"] = pc["evaluate_s"] / hf["evaluate_s"]
        diffs, greedy_same, same_text = [], True, True
        for sa, sb in zip(hf["samples"], pc["samples"]):
            assert sa["doc_id"] == sb["doc_id"] and sa["arguments"] == sb["arguments"]
            for ra, rb in zip(sa["resps"], sb["resps"]):
                a, b = ra[0], rb[0]
                if isinstance(a, str):
                    same_text &= a == b
                else:
                    diffs.append(abs(a[0] - b[0]))
                    greedy_same &= a[1] == b[1]
        if diffs:
            row["max_abs_loglik_diff"] = max(diffs)
            row["greedy_all_match"] = greedy_same
        else:
            row["same_generations"] = same_text
        row["same_requests"] = hf["pairs"] == pc["pairs"] and [p for p, _ in hf["generations"]] == [
            p for p, _ in pc["generations"]
        ]
    return row


# ---- report --------------------------------------------------------------------------------------------------
def markdown(rows: list[dict[str, Any]]) -> str:
    def f(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    head = (
        "| task | items / requests | score hf | score prefixcache | max abs Δ loglik | greedy / generations match "
        "| hf s | prefixcache s | ratio | whole run ratio | tokens fed (hf) | avoidable | speed-up bound "
        "| prefixcache computed | computed / unavoidable |"
    )
    lines = [head, "| --- | ---: | ---: | ---: | ---: | :---: | " + "---: | " * 9]
    for r in rows:
        match = r.get("greedy_all_match", r.get("same_generations"))
        lines.append(
            f"| {r['task']} | {r['items']} / {r['requests']} | {f(r.get('hf_score'), '.3f')} "
            f"| {f(r.get('prefixcache_score'), '.3f')} | {f(r.get('max_abs_loglik_diff'), '.1e')} "
            f"| {'-' if match is None else ('yes' if match else 'NO')} | {f(r.get('hf_model_s'), '.1f')} "
            f"| {f(r.get('prefixcache_model_s'), '.1f')} | {f(r.get('time_ratio'), '.3f')}x "
            f"| {f(r.get('evaluate_ratio'), '.3f')}x | {r['fed']:,} "
            f"| {r['avoidable']:,} | {r['speedup_bound']:.2f}x | {f(r.get('computed_prefill'), ',')} "
            f"| {f(r.get('computed_over_unavoidable'), '.3f')}x |"
        )
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> list[tuple[str, float, str, bool]]:
    out = []
    for r in rows:
        if "time_ratio" in r:
            t = TARGETS[r["task"]]
            out.append((f"{r['task']}: prefixcache / hf time", r["time_ratio"], f"<= {t}", r["time_ratio"] <= t))
        if "same_generations" in r:
            same = bool(r["same_generations"])
            out.append((f"{r['task']}: identical generations", float(same), "== 1", same))
        if "greedy_all_match" in r:
            ok = r["greedy_all_match"] and r["max_abs_loglik_diff"] <= 1e-4
            out.append(
                (f"{r['task']}: max |Δ loglik| (greedy flags all match)", r["max_abs_loglik_diff"], "<= 1e-4", ok)
            )
        if r.get("computed_over_unavoidable") is not None:
            v = r["computed_over_unavoidable"]
            out.append((f"{r['task']}: computed / unavoidable prefill", v, f"<= {PREFILL_TARGET}", v <= PREFILL_TARGET))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", help="built-in preset or local model directory")
    ap.add_argument("--items", type=int, default=100, help="multiple-choice questions; short answers get half")
    ap.add_argument("--tasks", default="abc", help="which tasks (letters a-c)")
    ap.add_argument("--models", default="hf,prefixcache", help="which lm-eval models, comma-separated")
    ap.add_argument("--block-size", type=int, default=None, help="prefixcache block size (default: PrefixCacheLM's)")
    ap.add_argument("--max-cached-tokens", type=int, default=32768, help="prefixcache KV pool, in tokens")
    ap.add_argument("--max-step-tokens", type=int, default=None, help="prefixcache engine step budget")
    ap.add_argument("--max-gen-toks", type=int, default=10, help="short answers: tokens generated at most")
    ap.add_argument(
        "--commit-continuations", action="store_true", help="prefixcache also caches the scored continuations"
    )
    ap.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="lm-eval's batch size (hf: scoring and generation; prefixcache: generation, its scoring batches itself)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the results as JSON")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not set(models) <= {"hf", "prefixcache"} or not set(args.tasks) <= set(TASKS):
        ap.error("--models takes hf and/or prefixcache; --tasks letters a, b, c")

    from lm_eval.models.huggingface import HFLM

    from engine.lm_eval_model import PrefixCacheLM
    from engine.models import load_model

    meta = _meta.begin(peers=("lm_eval",))
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_lm_eval_") as tmp:
        folder = Path(tmp)
        build_tasks(folder, args.items, max(2, args.items // 2), args.max_gen_toks, args.seed)
        model_dir = folder / "model"
        if Path(args.model).is_dir():
            model_dir = Path(args.model)
        else:
            model, tokenizer = load_model(args.model, seed=args.seed)
            model.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
            del model
        common = {
            "pretrained": str(model_dir),
            "dtype": "float32",
            "device": args.device,
            "batch_size": args.batch_size,
        }
        lms: dict[str, Any] = {}
        if "hf" in models:
            lms["hf"] = HFLM(**common)
        if "prefixcache" in models:
            extra = {
                "block_size": args.block_size,
                "max_step_tokens": args.max_step_tokens,
                "commit_continuations": args.commit_continuations,
            }
            lms["prefixcache"] = PrefixCacheLM(
                **common, max_cached_tokens=args.max_cached_tokens, **{k: v for k, v in extra.items() if v}
            )
        setup_s = {name: warm_up(lm) for name, lm in lms.items()}
        probes = {name: Probe(lm) for name, lm in lms.items()}
        max_length = next(iter(lms.values())).max_length
        for letter in args.tasks:
            task = TASKS[letter]
            runs = {name: run_task(lms[name], probes[name], task, folder) for name in lms}
            rows.append(compare(task, runs, max_length))
            print(f"{task}: done", file=sys.stderr)
        pcm = lms["prefixcache"].prefix_cached if "prefixcache" in lms else None
        info = {
            "setup_s": setup_s,
            "block_size": pcm.block_size if pcm is not None else None,
            "engine_config": vars(pcm.engine().config) if pcm is not None and pcm.engine() is not None else None,
        }

    print(
        f"\nlm-eval on `{args.model}` ({args.device}, {torch.get_num_threads()} threads), prefixcache block size "
        f"{info['block_size']}, pool {args.max_cached_tokens:,} tokens; seconds inside the model's request methods "
        "(whole run: lm-eval's simple_evaluate, task building and metrics included); set-up before the tasks, not "
        f"counted: {', '.join(f'{k} {v:.2f} s' for k, v in setup_s.items())}\n"
    )
    print(markdown(rows))
    print()
    checks = targets(rows)
    for what, value, target, met in checks:
        print(f"{what}: {value:.4g} (target {target}) {'OK' if met else 'MISSED'}")
    if args.json:
        payload = {
            "meta": _meta.end(meta),
            "args": vars(args) | {"json": str(args.json)},
            "prefixcache": info,
            "host": {
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "load_before": load_before,
                "load_after": os.getloadavg(),
                "torch": torch.__version__,
            },
            "rows": rows,
            "targets": [{"what": w, "value": v, "target": t, "met": m} for w, v, t, m in checks],
        }
        args.json.write_text(json.dumps(payload, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
