"""lm-evaluation-harness on prefixcache: the ``prefixcache`` model (``lm_eval --model prefixcache``).

``PrefixCacheLM`` is lm-eval's ``HFLM`` (``--model hf``) with its model wrapped in a ``PrefixCachedModel``, so
tokenization, chat templates, few-shot contexts, truncation and post-processing are lm-eval's own:

- ``loglikelihood`` (multiple choice) and ``loglikelihood_rolling`` (perplexity) end in ``_loglikelihood_tokens``,
  which hands every request of the call to one ``PrefixCachedModel.score``: token-sequence order, an item's choices
  and shared few-shot exemplars computed once, each context's last token and its continuation computed per request.
  Same semantics as HFLM (``(context + continuation)[-(max_length + 1):]``), the log-softmax always in float32
  (HFLM's runs in the model's dtype: compare a bf16 model with ``--model hf`` given ``softmax_dtype=float32``).
- ``generate_until`` is HFLM's: its ``self.model.generate(...)`` is ``PrefixCachedModel.generate``, which serves
  each prompt's cached prefix (stopping criteria, left-padded batches and the attention mask included).

Importing this module registers the model with lm-eval (lm-eval has no plugin entry points): ``prefixcache eval``
does, or ``import engine.lm_eval_model`` before ``lm_eval.simple_evaluate(model="prefixcache", ...)``, or pass an
instance: ``lm_eval.simple_evaluate(model=PrefixCacheLM(pretrained=DIR), tasks=[...])``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from engine.batching.scheduler import SchedulerConfig
from engine.models import PRESETS, load_model
from engine.wrapper import DEFAULT_MAX_CACHED_TOKENS, PrefixCachedModel

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 4  # a request recomputes up to block_size - 1 cached context tokens (README: Evaluation)


@register_model("prefixcache")
class PrefixCacheLM(HFLM):  # type: ignore[misc]  # lm-eval is untyped: HFLM is Any to mypy
    """HFLM over a ``PrefixCachedModel``. ``pretrained``: a local model directory (loaded as HFLM loads it, local
    files only) or a built-in preset ("tiny", "small"; ``seed`` seeds its weights). The cache: a KV pool of
    ``max_cached_tokens`` (or ``max_cached_bytes``) in blocks of ``block_size`` tokens, preallocated on the model's
    device (default the wrapper's 32,768 tokens: 2.4 GB of the ``small`` preset in float32; it must hold the
    longest request);
    ``commit_continuations`` also caches scored continuations (worth it when continuations are contexts of later
    requests). ``max_step_tokens``, ``max_chunk_tokens``,
    ``max_running``: the engine's step budget (see ``engine.batching.scheduler``). Every other argument is HFLM's;
    ``device`` defaults to CUDA when there is one, else the CPU."""

    def __init__(
        self,
        pretrained: Any = "tiny",
        *,
        max_cached_tokens: int | None = None,
        max_cached_bytes: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        commit_continuations: bool = False,
        max_step_tokens: int | None = None,
        max_chunk_tokens: int | None = None,
        max_running: int | None = None,
        seed: int = 0,
        device: str | None = None,
        dtype: Any = "auto",
        **kwargs: Any,
    ) -> None:
        for name in ("mixed_precision_dtype", "softmax_dtype"):
            if kwargs.get(name) not in (None, "float32", torch.float32):
                raise ValueError(f"prefixcache: {name}={kwargs[name]!r} is not supported (scores are float32)")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if isinstance(pretrained, str) and pretrained in PRESETS and not Path(pretrained).is_dir():
            model, tokenizer = load_model(
                pretrained, dtype=None if dtype == "auto" else dtype, device=device, seed=seed
            )
            kwargs.setdefault("tokenizer", tokenizer)
            super().__init__(pretrained=model, device=device, dtype=dtype, **kwargs)
            self.pretrained = pretrained  # a name for the results, not the model object
        else:
            if isinstance(pretrained, str) and not Path(pretrained).is_dir():
                known = ", ".join(sorted(PRESETS))
                raise ValueError(
                    f"prefixcache: pretrained={pretrained!r} is neither a local model directory nor a preset ({known})"
                )
            if isinstance(pretrained, str):
                kwargs.setdefault("local_files_only", True)
            super().__init__(pretrained=pretrained, device=device, dtype=dtype, **kwargs)
        limits = {"max_step_tokens": max_step_tokens, "max_chunk_tokens": max_chunk_tokens, "max_running": max_running}
        given: dict[str, Any] = {k: v for k, v in limits.items() if v is not None}
        config = SchedulerConfig(**given) if given else None
        if max_cached_tokens is None and max_cached_bytes is None:
            max_cached_tokens = DEFAULT_MAX_CACHED_TOKENS
        self._model: PrefixCachedModel = PrefixCachedModel(
            self._model,
            max_cached_tokens=max_cached_tokens,
            max_cached_bytes=max_cached_bytes,
            block_size=block_size,
            engine_config=config,
        )
        self.commit_continuations = bool(commit_continuations)

    @property
    def prefix_cached(self) -> PrefixCachedModel:
        """The wrapped model (``cache_stats()``, ``engine().stats``, ``reset_cache()``)."""
        return self._model

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[Any, list[int], list[int]]],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        """(log P(continuation | context), is greedy) for every (cache key, context ids, continuation ids), in
        order, from one ``score`` call over all of them (``override_bs`` is moot: the engine batches). Changes the
        cache; records each answer with a cache key in lm-eval's request cache."""
        if not requests:
            return []
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        too_long = sum(len(c) + len(k) > self.max_length + 1 for c, k in pairs)
        if too_long:
            log.warning(
                "prefixcache: %d request(s) longer than max_length=%d + 1: cut from the left", too_long, self.max_length
            )
        results = self.prefix_cached.score(
            pairs,
            max_length=self.max_length,
            commit_continuations=self.commit_continuations,
            progress_bar=not disable_tqdm and self.rank == 0 and len(pairs) > 1,
        )
        out = []
        for (key, _, _), r in zip(requests, results):
            answer = (r.logprob, r.is_greedy)
            if key is not None:  # loglikelihood_rolling's windows have none: it records whole documents itself
                self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def get_model_info(self) -> dict[str, Any]:
        """HFLM's model info without asking the Hub for a revision hash (local files only), plus the cache's
        settings."""
        model = self.prefix_cached.model
        return {
            "model_num_parameters": model.num_parameters(),
            "model_dtype": str(model.dtype),
            "model_revision": self.revision,
            "model_sha": "",
            "prefix_cache": {
                "block_size": self.prefix_cached.block_size,
                "num_blocks": self.prefix_cached.cache.num_blocks,
                "commit_continuations": self.commit_continuations,
            },
        }


def cli_main(argv: list[str]) -> int:
    """Run lm-eval's command line (``lm_eval ARGS...``) on ``argv`` with the ``prefixcache`` model registered;
    returns its exit status. ``sys.argv`` is restored afterwards."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    from engine.malloc import keep_freed_memory

    keep_freed_memory()  # `prefixcache eval` is this process, as `serve` is: freed temporaries stay in the heap
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved
    return 0
