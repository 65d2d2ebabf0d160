"""Whether a hybrid model continues exactly from a saved recurrent state: a probe, run once per model.

A prompt's logits from one forward are compared with the same prompt in two chunks, the second chunk starting
from the state the first left (as a request restored from a snapshot runs). Where a family's multi-token forward
over a previous state is inexact (transformers' Jamba scan starts from zeros), the same is tried with the
recurrent modules fed such inputs one token at a time; a model that is exact neither way is refused.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from engine.hybrid import recurrent
from engine.hybrid.states import StateSpec, spec_of

PROBE_TOKENS = 64
PROBE_CUT = 32


def tolerance(model: torch.nn.Module) -> float:
    """The largest relative logit difference the probe accepts: in float32, 1e-5 (rounding is ~1e-7; a state
    restored inexactly, e.g. a scan started from zeros, is ~1e-4); in half precision, two units in the last place
    (bfloat16's unit is 7.8e-3: there an inexact restore is below the rounding)."""
    dtype = next(model.parameters()).dtype
    return 1e-5 if dtype in (torch.float32, torch.float64) else 2 * torch.finfo(dtype).eps


def probe_cache(model: PreTrainedModel) -> DynamicCache:
    """A fresh cache of ``model``'s own layer types after a two-token forward of one sequence (what its layers hold:
    ``layer_state.audit``, ``spec_of``). Changes nothing."""
    cache = recurrent.fresh_template(model)
    ids = torch.zeros((1, 2), dtype=torch.long, device=_device(model))
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True, position_ids=torch.arange(2, device=ids.device)[None])
    return cache


def probe_spec(model: PreTrainedModel) -> StateSpec:
    """The state of one sequence of ``model`` (``probe_cache``'s). Changes nothing."""
    return spec_of(probe_cache(model))


def chunked_difference(model: PreTrainedModel, *, tokenwise: bool, seed: int = 0) -> float:
    """Max |logit difference| between one forward over a random prompt and the same prompt in two chunks (the
    second from the state the first left; ``tokenwise``: inside ``recurrent.stepwise``), relative to the logits'
    scale. Changes nothing (the modules must be installed for ``tokenwise`` to matter)."""
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    gen = torch.Generator().manual_seed(seed)
    device = _device(model)
    ids = torch.randint(0, vocab, (1, PROBE_TOKENS), generator=gen).to(device)
    pos = torch.arange(PROBE_TOKENS, device=device)[None]
    with torch.inference_mode():
        ref = model(input_ids=ids, position_ids=pos).logits[0, PROBE_CUT:].float()
        cache = recurrent.fresh_template(model)
        model(input_ids=ids[:, :PROBE_CUT], position_ids=pos[:, :PROBE_CUT], cache=cache, use_cache=True)
        if tokenwise:
            with recurrent.stepwise():
                got = model(input_ids=ids[:, PROBE_CUT:], position_ids=pos[:, PROBE_CUT:], cache=cache, use_cache=True)
        else:
            got = model(input_ids=ids[:, PROBE_CUT:], position_ids=pos[:, PROBE_CUT:], cache=cache, use_cache=True)
    out = got.logits[0].float()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1.0))


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
