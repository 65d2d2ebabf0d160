"""lm-evaluation-harness on prefixcache (``--model prefixcache``) against lm-eval's own ``--model hf`` on the same
saved model: local tasks (multiple choice with few-shot exemplars, 1-token and multi-token choices; short
generations with a stop string), run by lm-eval itself, offline. Scores, greedy flags, accuracies and generations
must match hf's; the cache must have served tokens; contexts beyond max_length are cut as hf cuts them; the
``prefixcache eval`` command runs lm-eval's CLI with the model registered."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

import lm_eval
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from typer.testing import CliRunner

from engine.lm_eval_model import PrefixCacheLM
from engine.models import load_model
from prefixcache import cli

TOL = 1e-4
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "apple", "seven", "green", "quick", "fox", "dog"]


@pytest.fixture(scope="module", autouse=True)
def offline_and_one_thread():
    """No Hub access, and one torch thread: the tiny model's matmuls are microseconds, and two threads on a CPU
    shared with other work spend far longer at their barriers than computing."""
    import datasets.config
    import huggingface_hub.constants

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The ``tiny`` preset saved as a local Hugging Face model folder."""
    out = tmp_path_factory.mktemp("tiny_model")
    model, tokenizer = load_model("tiny")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _words(rnd, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """Two local tasks: ``pc_mc`` (8 multiple-choice docs, 2-shot from a train split; half the docs' choices are
    single characters, one token each, the others several words) and ``pc_gen`` (6 short answers, 2-shot, the
    same exemplars for every doc, stopping at a newline)."""
    import random

    out = tmp_path_factory.mktemp("tasks")
    rnd = random.Random(7)

    def mc_doc(i: int) -> dict:
        choices = list("ABCD") if i % 2 else [_words(rnd, 1 + k % 3) for k in range(4)]
        return {"question": _words(rnd, 10) + "?", "choices": choices, "answer": i % 4}

    def gen_doc(i: int) -> dict:
        return {"q": _words(rnd, 8) + "?", "a": _words(rnd, 1)}

    files = {
        "mc_train": [mc_doc(i) for i in range(6)],
        "mc_test": [mc_doc(i) for i in range(8)],
        "gen_train": [gen_doc(i) for i in range(4)],
        "gen_test": [gen_doc(i) for i in range(6)],
    }
    for name, rows in files.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = out / "hf_datasets"
    (out / "pc_mc.yaml").write_text(
        f"""task: pc_mc
dataset_path: json
dataset_kwargs:
  data_files: {{train: {out}/mc_train.jsonl, test: {out}/mc_test.jsonl}}
  cache_dir: {cache}
output_type: multiple_choice
training_split: train
fewshot_split: train
test_split: test
num_fewshot: 2
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
target_delimiter: ""
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
    )
    (out / "pc_gen.yaml").write_text(
        f"""task: pc_gen
dataset_path: json
dataset_kwargs:
  data_files: {{train: {out}/gen_train.jsonl, test: {out}/gen_test.jsonl}}
  cache_dir: {cache}
output_type: generate_until
training_split: train
fewshot_split: train
test_split: test
num_fewshot: 2
fewshot_config:
  sampler: first_n
doc_to_text: "Q: {{{{q}}}}\\nA:"
doc_to_target: "{{{{a}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
    )
    return out


def evaluate(model, task_dir: Path, tasks: list[str], **kw) -> dict:
    """lm-eval's simple_evaluate on the local tasks (built-in tasks not indexed), samples logged."""
    tm = TaskManager(include_path=str(task_dir), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=tm, log_samples=True, **kw)


def hf(model_dir: Path, **extra) -> str:
    """``--model_args`` for the hf model."""
    args = {"pretrained": str(model_dir), "dtype": "float32", **extra}
    return ",".join(f"{k}={v}" for k, v in args.items())


def spy_generate(lm) -> list[tuple[list[int], list[int], object]]:
    """Record every ``lm.model.generate`` call lm-eval's generate_until makes: per row, the prompt (padding
    stripped), the generated tokens and (through a PrefixCachedModel) its RowStats."""
    model, calls = lm.model, []
    generate = model.generate

    def spy(*args, **kwargs):
        out = generate(*args, **kwargs)
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        stats = getattr(model, "last_request_stats", ()) or [None] * ids.shape[0]
        for r in range(ids.shape[0]):
            pad = int((mask[r] == 0).sum())
            calls.append((ids[r, pad:].tolist(), out[r, ids.shape[1] :].tolist(), stats[r]))
        return out

    model.generate = spy
    return calls


@pytest.fixture(scope="module")
def runs(model_dir, task_dir) -> dict:
    """Both tasks through lm-eval's hf model (batch size 1) and through a PrefixCacheLM (the Python route; batch
    size 2, so generate_until hands the cached generate left-padded batches); every generate call recorded."""
    ref = HFLM(pretrained=str(model_dir), dtype="float32", device="cpu")
    lm = PrefixCacheLM(pretrained=str(model_dir), dtype="float32", device="cpu", max_cached_tokens=8192, batch_size=2)
    generated = {"hf": spy_generate(ref), "pc": spy_generate(lm)}
    return {
        "hf": evaluate(ref, task_dir, ["pc_mc", "pc_gen"]),
        "pc": evaluate(lm, task_dir, ["pc_mc", "pc_gen"]),
        "lm": lm,
        "generated": generated,
    }


def loglik_pairs(res_a: dict, res_b: dict, task: str) -> list[tuple[tuple, tuple, tuple]]:
    """(arguments, a's (loglik, greedy), b's) for every request of ``task``, matched by doc and choice."""
    out = []
    for sa, sb in zip(res_a["samples"][task], res_b["samples"][task]):
        assert sa["doc_id"] == sb["doc_id"] and sa["arguments"] == sb["arguments"]
        for args, ra, rb in zip(sa["arguments"], sa["resps"], sb["resps"]):
            out.append((args, ra[0], rb[0]))
    return out


def test_multiple_choice_matches_hf(runs):
    a, b = runs["hf"], runs["pc"]
    pairs = loglik_pairs(a, b, "pc_mc")
    assert len(pairs) == 8 * 4
    lengths = {len(cont) for (_, cont), _, _ in pairs}  # byte tokens: characters
    assert min(lengths) == 1 and max(lengths) > 5  # 1-token and multi-token continuations
    for args, (ll_a, greedy_a), (ll_b, greedy_b) in pairs:
        assert abs(ll_a - ll_b) <= TOL, args
        assert greedy_a == greedy_b, args
    assert a["results"]["pc_mc"]["acc,none"] == b["results"]["pc_mc"]["acc,none"]


def test_generations_match_hf(runs):
    a, b = runs["hf"]["samples"]["pc_gen"], runs["pc"]["samples"]["pc_gen"]
    assert len(a) == 6
    for sa, sb in zip(a, b):
        assert sa["arguments"] == sb["arguments"]
        assert sa["resps"] == sb["resps"]
    assert runs["hf"]["results"]["pc_gen"] == runs["pc"]["results"]["pc_gen"]
    # the tokens too (random weights generate bytes that decode to the same replacement characters)
    hf_gen, pc_gen = runs["generated"]["hf"], runs["generated"]["pc"]
    assert sorted((p, out) for p, out, _ in hf_gen) == sorted((p, out) for p, out, _ in pc_gen)
    assert sum(len(out) for _, out, _ in hf_gen) > 6  # something was generated


def test_the_cache_served_tokens(runs):
    pcm = runs["lm"].prefix_cached
    stats = pcm.cache_stats()
    assert stats["cached_tokens"] > 0 and stats["uncached_calls"] == 0
    # generate_until went through the cached generate: after the first batch, every prompt found the exemplars
    gen = [row for _, _, row in runs["generated"]["pc"]]
    assert len(gen) == 6 and all(r.cached_tokens > 0 for r in gen[2:])
    # scoring computed fewer prefill tokens than the requests hold: the exemplars and each item's context once
    fed = sum(len(ctx) + len(cont) for s in runs["pc"]["samples"]["pc_mc"] for ctx, cont in s["arguments"])
    assert pcm.engine().stats.prefill_tokens < 0.6 * fed


def test_local_completions_against_prefixcache_serve_gives_the_in_process_results(runs, model_dir, task_dir):
    """lm-eval's OpenAI-style backend against ``prefixcache serve``: log-likelihoods (echo + logprobs, token-id
    prompts) and greedy flags equal the in-process model's, generate_until (stop strings) gives its generations,
    and the server's cache serves the shared contexts."""
    from lm_eval.api.registry import get_model
    from serve_testutil import server_thread

    from engine import ModelRuntime, RuntimeConfig
    from engine.serve.app import create_app
    from engine.serve.backend import LocalBackend

    runtime = ModelRuntime.load(str(model_dir), RuntimeConfig(max_cached_tokens=8192, block_size=4))
    backend = LocalBackend(runtime, str(model_dir))
    with server_thread(create_app(backend)) as url:
        api = get_model("local-completions")(
            model=str(model_dir),
            base_url=f"{url}/v1/completions",
            tokenizer=str(model_dir),
            tokenizer_backend="huggingface",
            tokenized_requests=True,
            add_bos_token=True,  # as hf's tokenizer does by default; the API backend leaves BOS out unless told
            max_retries=1,
        )
        served = evaluate(api, task_dir, ["pc_mc", "pc_gen"])
    pairs = loglik_pairs(runs["pc"], served, "pc_mc")
    assert len(pairs) == 8 * 4
    for args, (ll_a, greedy_a), (ll_b, greedy_b) in pairs:
        assert abs(ll_a - ll_b) <= TOL, args
        assert greedy_a == greedy_b, args
    in_process, over_http = runs["pc"]["samples"]["pc_gen"], served["samples"]["pc_gen"]
    assert len(over_http) == 6
    assert [x["resps"] for x in over_http] == [x["resps"] for x in in_process]
    stats = runtime.cache_stats()
    assert stats["cached_tokens"] > 0.5 * stats["prompt_tokens"]  # choices share their item's context
    runtime.cache.check_integrity()
    assert runtime.cache.num_active_requests == 0


def test_context_beyond_max_length_is_cut_as_hf_cuts_it(model_dir, task_dir):
    max_length = 40
    lm = PrefixCacheLM(pretrained=str(model_dir), dtype="float32", device="cpu", max_length=max_length)
    a = evaluate("hf", task_dir, ["pc_mc"], model_args=hf(model_dir, max_length=max_length), device="cpu", limit=4)
    b = evaluate(lm, task_dir, ["pc_mc"], limit=4)
    pairs = loglik_pairs(a, b, "pc_mc")
    assert all(len(ctx) > 2 * max_length for (ctx, _), _, _ in pairs)  # bytes = tokens: every one is cut
    for args, (ll_a, greedy_a), (ll_b, greedy_b) in pairs:
        assert abs(ll_a - ll_b) <= TOL, args
        assert greedy_a == greedy_b, args


def test_loglikelihood_rolling_matches_hf(model_dir):
    """Perplexity windows (max_length 32: several per document) go through the overridden scoring."""
    text = "the quick brown fox jumps over the lazy dog; " * 3
    reqs = [Instance("loglikelihood_rolling", {}, (text[:n],), i) for i, n in enumerate((20, 90, len(text)))]
    ref = HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", max_length=32).loglikelihood_rolling(reqs)
    lm = PrefixCacheLM(pretrained=str(model_dir), dtype="float32", device="cpu", max_length=32)
    got = lm.loglikelihood_rolling(reqs)
    assert len(got) == 3
    for x, y in zip(ref, got):
        assert abs(x - y) <= TOL


def test_preset_names_load_without_a_folder():
    lm = PrefixCacheLM(pretrained="tiny", device="cpu", block_size=8)
    assert lm.prefix_cached.block_size == 8 and lm.max_length == 2048
    [(ll, _)] = lm._loglikelihood_tokens([(None, [256, 72, 105], [33])])
    assert ll < 0
    with pytest.raises(ValueError, match="neither a local model directory nor a preset"):
        PrefixCacheLM(pretrained="no/such/model")


@pytest.mark.timeout(600)  # a subprocess that imports lm-eval and runs a task: ~70 s on 2 loaded cores
def test_cli_runs_lm_eval_with_the_model_registered(model_dir, task_dir, tmp_path):
    """No --model: the prefixcache model (lm-eval's own default would be hf, uncached)."""
    out = tmp_path / "results"
    args = ["--model_args", f"pretrained={model_dir},dtype=float32,max_cached_tokens=4096"]
    args += ["--tasks", "pc_mc", "--include_path", str(task_dir), "--limit", "2", "--device", "cpu"]
    result = CliRunner().invoke(cli.app, ["eval", *args, "--output_path", str(out)])
    assert result.exit_code == 0, result.output
    assert "pc_mc" in result.output and "acc" in result.output
    written = list(out.rglob("results_*.json"))  # lm-eval wrote its results
    assert written and json.loads(written[0].read_text())["config"]["model"] == "prefixcache"


def test_cli_refuses_another_model_and_defaults_to_prefixcache():
    from prefixcache.cli.eval import with_model

    assert with_model(["--model_args", "pretrained=small", "--tasks", "t"]) == [
        "--model",
        "prefixcache",
        "--model_args",
        "pretrained=small",
        "--tasks",
        "t",
    ]
    assert with_model(["--model=prefixcache", "--tasks", "t"]) == ["--model=prefixcache", "--tasks", "t"]
    assert with_model(["--help"]) == ["--help"]
    for args in (["--model", "hf", "--tasks", "t"], ["--tasks", "t", "--model=hf"], ["--model"]):
        result = CliRunner().invoke(cli.app, ["eval", *args])
        assert result.exit_code == 2, args
        assert "prefixcache eval runs lm-eval's --model prefixcache" in result.output
        assert len(result.output.strip().splitlines()) == 1


def test_cli_names_the_extra_when_lm_eval_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    result = CliRunner().invoke(cli.app, ["eval", "--tasks", "x"])
    assert result.exit_code == 2
    assert "pip install 'prefixcache[eval]'" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_cli_turns_a_value_error_into_one_line(monkeypatch):
    """lm-eval raises ValueError for an unknown task; the model for a bad path (faked here: a real run first
    indexes every built-in task, ~10 s)."""
    import engine.lm_eval_model as module

    def fail(argv):
        raise ValueError(f"Tasks not found: {argv[-1]}")

    monkeypatch.setattr(module, "cli_main", fail)
    result = CliRunner().invoke(cli.app, ["eval", "--tasks", "no_such_task"])
    assert result.exit_code == 2
    assert result.output.strip() == "error: Tasks not found: no_such_task"
