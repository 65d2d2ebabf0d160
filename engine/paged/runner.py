"""PagedRunner: one forward of a flat batch through a model whose KV lives in a ``KVPool``.

The model runs on its own modeling code with its attention implementation switched, for the forward only, to
``paged_attention`` (``engine.paged.attention``), and its cache replaced by ``PagedKV``: the new tokens' keys and
values go straight into the pool, attention reads them there. Logits are computed for the positions asked for
only (``logits_to_keep`` as an index tensor, where the model takes it).

``paged_unsupported_reason(model, pool)`` says why a model cannot run this way (and must use the wrapper's
contiguous path): no ``AttentionInterface`` dispatch, layers without KV of their own, attention sinks, or a probe
forward whose logits differ from the model's own.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DummyLayer, DynamicCache, LinearAttentionCacheLayerMixin

from engine import hf_cache
from engine.hybrid import recurrent
from engine.hybrid.recurrent import Segment
from engine.hybrid.states import StatePool
from engine.kv_pool import KVPool
from engine.paged.attention import ATTENTION_NAME, PagedKV, Row, StepBatch, paged_attention, use_batch
from engine.paged.last_rows import LastLayerRows
from engine.paged.lean import LeanLayers

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

PROBE_TOLERANCE = 1e-3  # max |logit difference| of the probe forward, relative to the logits' scale
# ... or this many times the model's own difference between the probe's two chunks and one pass (own_difference)
OWN_DIFFERENCE_SLACK = 2.0
_registered = threading.Lock()
AttentionInterface.register(ATTENTION_NAME, paged_attention)


class PagedRunner:
    """Runs ``StepBatch``es of ``model`` over ``pool`` (the pool's layers must be the model's). Not thread-safe:
    one forward at a time (the engine's loop)."""

    def __init__(
        self, model: PreTrainedModel, pool: KVPool, *, use_kernel: bool = True, states: StatePool | None = None
    ) -> None:
        self.model = model
        self.pool = pool
        self.states = states  # a hybrid model's recurrent-state pool (its modules are wrapped: engine.hybrid)
        self._num_layers = len(pool.specs)
        self.use_kernel = use_kernel and all(s is None or s.k_shape == s.v_shape for s in pool.specs)
        self._cache_kwarg = hf_cache.cache_kwarg(model)
        params = inspect.signature(type(model).forward).parameters
        self._keep_param = "logits_to_keep" in params
        self._configs = _attention_configs(model)
        # the last layer's output projection and MLP at the kept positions only (needs the logits kept by index)
        self.last_rows = LastLayerRows(model) if self._keep_param else None
        self.lean = LeanLayers(model)  # known decoder layers as one function each (the same ops, less dispatch)

    def batch(self, rows: list[Row]) -> StepBatch:
        """The ``StepBatch`` of ``rows`` on this runner's pool."""
        return StepBatch.make(self.pool, rows, use_kernel=self.use_kernel)

    def forward(
        self,
        batch: StepBatch,
        input_ids: torch.Tensor,
        logits_at: torch.Tensor,
        segments: Sequence[Segment] = (),
    ) -> torch.Tensor:
        """Run the step: ``input_ids`` [T] (the rows' new tokens, in order); returns the logits [n, vocab] at the
        flat positions ``logits_at`` [n]. Writes every new token's K/V into the pool at the batch's slots; a hybrid
        model's rows (``segments``, one per row) advance their recurrent states in their state slots."""
        device = self.pool.device
        ids = input_ids.to(device).unsqueeze(0)
        at = logits_at.to(device)
        kwargs: dict[str, Any] = {self._cache_kwarg: PagedKV(batch)}
        if self._keep_param:
            kwargs["logits_to_keep"] = at
        if self.states is None:
            states: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        else:
            states = recurrent.segments(self.states, list(segments), self._num_layers)
        last: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self.last_rows is not None:
            last = self.last_rows.active(at, ids.shape[1])
        with torch.inference_mode(), use_batch(batch), self._switched(), states, last, self.lean.active():
            out = self.model(input_ids=ids, position_ids=batch.positions.unsqueeze(0), use_cache=True, **kwargs)
        logits: torch.Tensor = out.logits[0]
        return logits if self._keep_param else logits[at]

    @contextmanager
    def _switched(self) -> Iterator[None]:
        """The model's attention implementation is ``ATTENTION_NAME`` inside (restored however it exits)."""
        old = [cfg._attn_implementation_internal for cfg in self._configs]
        try:
            for cfg in self._configs:
                cfg._attn_implementation_internal = ATTENTION_NAME
            yield
        finally:
            for cfg, name in zip(self._configs, old):
                cfg._attn_implementation_internal = name


def _attention_configs(model: torch.nn.Module) -> list[PretrainedConfig]:
    """Every distinct config object the model's modules read their attention implementation from."""
    seen: dict[int, PretrainedConfig] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation_internal"):
            seen.setdefault(id(cfg), cfg)
    return list(seen.values())


def paged_unsupported_reason(model: PreTrainedModel, pool: KVPool) -> str | None:
    """Why ``model`` cannot run on the paged path exactly, or None. Runs a small probe forward both ways (two
    chunks through the pool against one plain forward); changes no cached block (it uses the pool's last
    blocks and leaves garbage there only in blocks nobody owns... see ``probe_blocks``)."""
    name = type(model).__name__
    if hf_cache.unsupported_reason(model) is not None:
        return hf_cache.unsupported_reason(model)
    can = getattr(model, "_can_set_attn_implementation", None)
    if can is not None and not can():
        return f"{name} does not dispatch attention through transformers' AttentionInterface"
    missing = [i for i, s in enumerate(pool.specs) if s is None and i not in _stateless_or_recurrent(model)]
    if missing:
        return f"{name} has layers without keys and values of their own (shared KV) at {missing}"
    text = model.config.get_text_config(decoder=True)
    if "chunked_attention" in (getattr(text, "layer_types", None) or []) or (
        getattr(text, "attention_chunk_size", None) and not getattr(text, "layer_types", None)
    ):
        return f"{name} uses chunked attention, whose masks the paged attention does not build"
    for m in model.modules():
        if hasattr(m, "sinks") or hasattr(m, "s_aux"):
            return f"{name} uses attention sinks, which the paged attention does not implement"
    return None


def _stateless_or_recurrent(model: PreTrainedModel) -> set[int]:
    """Layers that rightly hold no K/V: recurrent ones (their state is kept elsewhere) and placeholders of layers
    without attention (an MLP-only layer). Changes nothing."""
    template = DynamicCache(config=model.config.get_text_config(decoder=True))
    kinds = list(getattr(model.config.get_text_config(decoder=True), "layer_types", None) or [])
    out = set()
    for i, layer in enumerate(template.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin) or (
            isinstance(layer, DummyLayer) and i < len(kinds) and kinds[i] in ("mlp", "moe")
        ):
            out.add(i)
    return out


def probe_difference(
    model: PreTrainedModel,
    pool: KVPool,
    blocks: Sequence[int],
    *,
    use_kernel: bool = True,
    seed: int = 0,
    states: StatePool | None = None,
    slot: int = 0,
) -> float:
    """Max |logit difference| between the paged path (the probe prompt in two chunks, KV in ``blocks`` of the
    pool, which the caller owns and may find overwritten; a hybrid model's state in slot ``slot`` of ``states``)
    and one plain forward, relative to the logits' scale. The first chunk takes logits at every position, the second
    at its last only (the last layer then computes that row alone: ``LastLayerRows``)."""
    ids, cut = _probe_prompt(model, pool, blocks, seed)
    n = len(ids)
    runner = PagedRunner(model, pool, use_kernel=use_kernel, states=states)
    first = runner.batch([Row(0, cut, cut, blocks)])
    got_a = runner.forward(first, ids[:cut], torch.arange(cut), [Segment(0, cut, slot, False)])
    second = runner.batch([Row(0, n - cut, n, blocks)])
    got_b = runner.forward(second, ids[cut:], torch.tensor([n - cut - 1]), [Segment(0, n - cut, slot, True)])
    got = torch.cat([got_a, got_b]).float()
    return _relative_to_one_pass(model, ids, cut, got.cpu())


def own_difference(model: PreTrainedModel, pool: KVPool, blocks: Sequence[int], *, seed: int = 0) -> float | None:
    """``probe_difference``'s measure for the model's own forward over transformers' ``DynamicCache`` in the probe's
    two chunks: how far the model itself moves with the shape of its calls. 0 where its kernels give a row the same
    bits whatever the rows beside it (oneDNN's native bf16 here); about a bf16 ulp where a library's results depend on
    the row count (oneDNN emulating bf16 without AVX512-BF16: rows past a block of 16 of a 33-row call differ from
    a 35-row one's). None where that forward cannot run (a model whose cache is not a plain ``DynamicCache``)."""
    from transformers import DynamicCache

    from engine.hf_cache import cache_kwarg

    ids, cut = _probe_prompt(model, pool, blocks, seed)
    dev, name = model.device, cache_kwarg(model)
    try:
        with torch.inference_mode():
            kw = {name: DynamicCache(config=model.config), "use_cache": True}
            a = model(input_ids=ids[:cut].unsqueeze(0).to(dev), **kw).logits[0]
            b = model(input_ids=ids[cut:].unsqueeze(0).to(dev), **kw).logits[0]
    except Exception:  # any model this plain two-call forward does not fit: no figure
        return None
    return _relative_to_one_pass(model, ids, cut, torch.cat([a, b[-1:]]).float().cpu())


def _probe_prompt(model: PreTrainedModel, pool: KVPool, blocks: Sequence[int], seed: int) -> tuple[torch.Tensor, int]:
    """The probe's token ids (two blocks and 3 tokens, at most what ``blocks`` hold) and where its second chunk
    starts."""
    bs = pool.block_size
    n = min(len(blocks) * bs, 2 * bs + 3)
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    return ids, max(1, n - 2)


def _relative_to_one_pass(model: PreTrainedModel, ids: torch.Tensor, cut: int, got: torch.Tensor) -> float:
    """Max |``got`` - the model's one-pass logits| over the rows ``got`` holds (the first chunk's, then the last
    token's), relative to the logits' scale."""
    with torch.inference_mode():
        ref = model(input_ids=ids.unsqueeze(0).to(model.device)).logits[0].float().cpu()
    ref = torch.cat([ref[:cut], ref[len(ids) - 1 :]])
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1.0))
