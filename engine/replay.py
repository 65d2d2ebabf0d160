"""Replaying a scenario through a real model: cached (PrefixCachedModel) vs uncached (the raw model).

For each request, in order: the prompt is rendered with the model's tokenizer (chat turns through its chat
template, with the conversation's earlier replies as text, like a chat client resends them); the uncached
baseline runs ``model.generate`` and the cached run ``PrefixCachedModel.generate`` on the same ids, both greedy
with ``max_new_tokens``. The cached run's reply joins the conversation's history.

TTFT is measured with a streamer: ``generate`` first hands the streamer the prompt, then each new token; the
time from the call to the second ``put`` is the time to the first generated token (prefill + first sampling
step). Total time is the whole ``generate`` call. The baseline runs right before the cached call of the same
request (in every replay of a sweep), so both see the same machine load. Before anything is timed, the first
request runs once uncached and twice through a throwaway wrapper (``_warm_up``): a process's first calls pay
one-time costs (hundreds of ms on the CPU) that would otherwise land on the first capacity of a sweep only.

On the built-in presets (random weights) generation is restricted to printable ASCII and ``<|eos|>``
(``suppress_tokens``, the same for cached and uncached) so that replies decode to text and re-encode to the
same tokens in the next turn, as a real model's replies do.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from engine.hybrid.hints import message_ends
from engine.memory import PoolTooLargeError
from engine.models import PRESETS, load_model
from engine.wrapper import PrefixCachedModel
from prefixcache.reports.record import TOP_SITES
from prefixcache.sim.causes import Fork
from prefixcache.sim.diagnosis import DivergenceSite, divergence_sites
from prefixcache.sim.policy import Capacity, measured_from
from prefixcache.sim.requests import from_scenario
from prefixcache.sim.results import Row, RunResult
from prefixcache.workload.render import Conversations
from prefixcache.workload.requests import Message
from prefixcache.workload.scenario import Scenario
from prefixcache.workload.trace import NO_TOKENS


class ReplayError(ValueError):
    """A scenario or model that cannot be replayed (e.g. a prompt longer than the model's context)."""


class TTFTStreamer:
    """Records when ``generate`` produced its first token (the second ``put``; the first is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()


class HFRenderer:
    """Renders requests with a Hugging Face tokenizer (its chat template for messages). With ``hints`` (a hybrid
    model), ``last_hints`` holds the last chat's message ends (``engine.hybrid.hints``), else ()."""

    def __init__(self, tokenizer: Any, *, hints: bool = False) -> None:
        self.tokenizer = tokenizer
        self.hints = hints
        self.last_hints: tuple[int, ...] = ()

    def encode_text(self, text: str) -> list[int]:
        self.last_hints = ()
        return list(self.tokenizer(text)["input_ids"])

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ReplayError("the model's tokenizer has no chat template; use text requests for this model")
        chat = [{"role": m.role, "content": m.content} for m in messages]
        out = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        if hasattr(out, "keys"):
            out = out["input_ids"]
        ids = list(out)
        self.last_hints = message_ends(self.tokenizer, chat, ids) if self.hints else ()
        return ids


def _timed_generate(
    fn: Callable[..., Any], ids: torch.Tensor, kwargs: dict[str, Any]
) -> tuple[list[int], float, float]:
    streamer = TTFTStreamer()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = fn(ids, attention_mask=torch.ones_like(ids), streamer=streamer, **kwargs)
    t1 = time.perf_counter()
    seq = out if isinstance(out, torch.Tensor) else out.sequences
    assert streamer.first is not None
    return seq[0, ids.shape[1] :].tolist(), streamer.first - t0, t1 - t0


def _ascii_only(tokenizer: Any) -> list[int]:
    """Ids to suppress on the built-in byte tokenizer: non-printable bytes and specials other than eos."""
    keep = set(range(32, 127)) | {10, tokenizer.eos_token_id}
    return [i for i in range(len(tokenizer)) if i not in keep]


UNLIMITED_MARGIN = 1.25


def _estimate_unlimited(scenario: Scenario, renderer: HFRenderer, block_size: int) -> int:
    """A pool that never evicts: the blocks the scenario inserts with synthetic replies of ``max_new_tokens``
    tokens (exact for the simulator), times a margin, because a model's replies, decoded to text and
    re-encoded in the next turn's history, may take a few more tokens than that."""
    blocks = from_scenario(scenario, block_size, renderer).max_inserted_blocks()
    return max(1, int(blocks * UNLIMITED_MARGIN))


def replay(
    scenario: Scenario,
    capacities: list[Capacity],
    *,
    model: str = "tiny",
    block_size: int = 16,
    eviction: str = "lru",
    warmup: float = 0.0,
    baseline: bool = True,
    dtype: Any = None,
    device: Any = None,
    seed: int = 0,
    loaded: tuple[Any, Any] | None = None,
    on_start: Callable[[Capacity, int], None] | None = None,
    on_row: Callable[[Row, Any], None] | None = None,
    sites: list[DivergenceSite] | None = None,
    disk_cache: str | os.PathLike[str] | None = None,
    max_disk_bytes: int | str | None = None,
) -> tuple[list[RunResult], dict[str, Any]]:
    """Replay ``scenario`` once per capacity through ``model`` (preset or local path; or ``loaded`` =
    (model, tokenizer)). Returns the per-capacity results and facts about the model for the run record; rows
    carry their miss causes (from the wrapper's ``last_request_stats``). ``sites``, when given, receives the
    run's top divergence points (they do not depend on the capacity; read from the first one).
    ``disk_cache``: a disk tier below each capacity's pool, in its own subdirectory ``pool-<capacity>`` (entries
    already there are served: a warm start), with ``max_disk_bytes`` each.

    A KeyboardInterrupt stops the replay; what ran comes back with ``partial=True`` (pins are always released).
    """
    if scenario.trace is not None:
        raise ReplayError(NO_TOKENS)
    with_images = next((r for r in scenario.requests if r.messages and any(m.images for m in r.messages)), None)
    if with_images is not None:
        where = f" (line {with_images.line})" if with_images.line else ""
        raise ReplayError(
            f"a request{where} carries images: a scenario's images are ids and token counts, not pictures, so it "
            "is simulated (simulate, plan, explain), not replayed through a model"
        )
    if loaded is None:
        try:
            loaded = load_model(model, dtype=dtype, device=device, seed=seed)
        except (ValueError, OSError) as exc:
            raise ReplayError(f"cannot load model {model!r}: {exc}") from None
    hf_model, tokenizer = loaded
    renderer = HFRenderer(tokenizer)
    gen: dict[str, Any] = {"do_sample": False}
    if tokenizer.pad_token_id is not None:
        gen["pad_token_id"] = tokenizer.pad_token_id
    if model in PRESETS and loaded is not None and len(tokenizer) <= 512:
        gen["suppress_tokens"] = _ascii_only(tokenizer)
    max_pos = getattr(hf_model.config, "max_position_embeddings", None)
    vocab = hf_model.config.get_text_config(decoder=True).vocab_size
    info: dict[str, Any] = {
        "model_class": type(hf_model).__name__,
        "dtype": str(next(hf_model.parameters()).dtype).removeprefix("torch."),
        "device": str(next(hf_model.parameters()).device),
        "ttft": "streamer: time from the generate call to its first generated token",
        "ttft_warmup": WARMUP_NOTE,
        "parameters": sum(p.numel() for p in hf_model.parameters()),
    }
    if scenario.requests:
        _warm_up(scenario, hf_model, renderer, gen, block_size, eviction, max_pos, vocab)
    results: list[RunResult] = []
    forks: dict[int, Fork] = {}
    unl: int | None = None
    for cap in capacities:
        if unl is None:
            unl = _estimate_unlimited(scenario, renderer, block_size)
        # the KV pool is allocated up front: a capacity above what the workload can fill gets the never-evicting size
        nb = unl if cap.blocks is None else min(cap.blocks, unl)
        if on_start is not None:
            on_start(cap, len(scenario))
        tier: dict[str, Any] = {}
        if disk_cache is not None:
            tier = {"disk_cache": Path(disk_cache) / f"pool-{cap.label(block_size)}", "max_disk_bytes": max_disk_bytes}
        try:
            pcm = PrefixCachedModel(
                hf_model,
                max_cached_tokens=nb * block_size,
                block_size=block_size,
                eviction=eviction,
                miss_history_tokens="unlimited",  # causes that do not depend on the pool's size
                **tier,
            )
        except PoolTooLargeError as exc:
            raise ReplayError(f"capacity {cap.label(block_size)}: {exc}") from None
        renderer.hints = pcm.runtime.hybrid is not None  # chats' message ends become snapshot hints
        res = _replay_one(
            scenario,
            pcm,
            hf_model,
            tokenizer,
            renderer,
            gen,
            nb,
            block_size,
            warmup,
            baseline,
            max_pos,
            vocab,
            cap,
            on_row,
            forks if not results else None,
        )
        results.append(res)
        if pcm.tier is not None:
            info.setdefault("tier", {})[cap.label(block_size)] = {
                k: v for k, v in pcm.cache_stats().items() if k.startswith("tier_")
            }
        pcm.close()
        del pcm
        if res.partial:
            break
    if sites is not None and results:
        # a tokenizer decodes one id list to one str (transformers annotates decode as str | list[str])
        sites += divergence_sites(results[0].rows, forks, lambda ids: cast(str, tokenizer.decode(list(ids))), TOP_SITES)
    return results, info


WARMUP_NOTE = (
    "one untimed uncached call and two cached ones (a miss, then a hit) of the first prompt, before any timing"
)


def _warm_up(
    scenario: Scenario,
    hf_model: Any,
    renderer: HFRenderer,
    gen: dict[str, Any],
    block_size: int,
    eviction: str,
    max_pos: int | None,
    vocab: int,
) -> None:
    """Run the first request untimed, uncached and through a throwaway wrapper (a miss, then a hit), so that the
    first timed call does not pay the process's one-time costs (kernels, allocator, the wrapper's first engine)
    and the first capacity of a sweep is timed like the others (``WARMUP_NOTE``)."""
    req = scenario.requests[0]
    prompt = Conversations().prompt(req, renderer)
    k = req.max_new_tokens or scenario.max_new_tokens
    _check_prompt(prompt, k, 0, req.line, max_pos, vocab)
    ids = torch.tensor([prompt], dtype=torch.long, device=next(hf_model.parameters()).device)
    kw = dict(gen, max_new_tokens=k, attention_mask=torch.ones_like(ids))
    blocks = -(-(len(prompt) + k) // block_size) + 1
    try:
        pcm = PrefixCachedModel(
            hf_model, max_cached_tokens=blocks * block_size, block_size=block_size, eviction=eviction
        )
    except PoolTooLargeError as exc:
        raise ReplayError(f"the warm-up's pool (the first prompt's {blocks} blocks): {exc}") from None
    with torch.inference_mode():
        hf_model.generate(ids, **kw)
        for _ in range(2):
            pcm.generate(ids, namespace=req.namespace, **kw)


def _check_prompt(prompt: list[int], k: int, i: int, line: int | None, max_pos: int | None, vocab: int) -> None:
    """ReplayError naming request ``i`` (0-based) when its prompt cannot run on the model."""
    where = f"request {i + 1}" + (f" (line {line})" if line else "")
    if max_pos is not None and len(prompt) + k > max_pos:
        raise ReplayError(f"{where}: {len(prompt)} prompt + {k} new tokens exceed the model's {max_pos} positions")
    if max(prompt) >= vocab:
        raise ReplayError(f"{where}: token id {max(prompt)} is outside the model's vocabulary ({vocab})")


def _replay_one(
    scenario: Scenario,
    pcm: PrefixCachedModel,
    hf_model: Any,
    tokenizer: Any,
    renderer: HFRenderer,
    gen: dict[str, Any],
    nb: int,
    bs: int,
    warmup: float,
    baseline: bool,
    max_pos: int | None,
    vocab: int,
    capacity: Capacity,
    on_row: Callable[[Row, Any], None] | None,
    forks: dict[int, Fork] | None,
) -> RunResult:
    conv = Conversations()
    n_warm = measured_from(len(scenario.requests), warmup)
    rows: list[Row] = []
    stats = pcm.cache.stats
    device = next(hf_model.parameters()).device
    partial = False
    try:
        for i, req in enumerate(scenario.requests):
            prompt = conv.prompt(req, renderer)
            k = req.max_new_tokens or scenario.max_new_tokens
            _check_prompt(prompt, k, i, req.line, max_pos, vocab)
            ids = torch.tensor([prompt], dtype=torch.long, device=device)
            kw = dict(gen, max_new_tokens=k)
            base = _timed_generate(hf_model.generate, ids, kw) if baseline else None
            evicted0 = stats.blocks_evicted
            hints = {"snapshot_hints": renderer.last_hints} if pcm.runtime.hybrid is not None else {}
            out, ttft, total = _timed_generate(pcm.generate, ids, dict(kw, namespace=req.namespace, **hints))
            rs = pcm.last_request_stats[0]
            reply = tokenizer.decode(out, skip_special_tokens=True)
            conv.add_reply(req, reply)
            row = Row(
                i,
                req.namespace,
                rs.prompt_tokens,
                rs.cached_tokens,
                -(-len(prompt) // bs),
                rs.cached_tokens // bs,
                rs.inserted_blocks,
                stats.blocks_evicted - evicted0,
                pcm.cache.num_cached_blocks,
                i < n_warm,
                req.timestamp,
                len(out),
                ttft,
                total,
                base[1] if base else None,
                base[2] if base else None,
                (base[0] == out) if base else None,
                rs.cold_tokens,
                rs.evicted_tokens,
                rs.diverged_tokens,
                rs.partial_block_tokens,
                rs.namespace_tokens,
                rs.not_cached_tokens,
                rs.no_state_tokens,
                None,  # no reuse distances: the wrapper learns its requests as they come
                rs.shared_tokens,
                rs.shared_with,
                None if pcm.tier is None else rs.tier_tokens,
                None if pcm.tier is None else rs.tier_tokens // bs,
                None if pcm.tier is None else pcm.tier.num_blocks,
            )
            if forks is not None and rs.divergence is not None:
                forks[i] = rs.divergence
            rows.append(row)
            if on_row is not None:
                on_row(row, pcm.cache)
    except KeyboardInterrupt:
        partial = True
    return RunResult(capacity, nb, bs, tuple(rows), partial)
