"""The check at load: the contiguous cached path, run end to end on a short probe and compared with the bare model.

transformers changes its cache internals every few releases; a change prefixcache does not know can make a restored
cache wrong without an error (5.25 added a token count to recurrent layers that a restore left at 0). So before a
model's first cached call, ``contiguous_reason`` runs the real path on random tokens: a prompt is stored (its KV
committed, a hybrid model's state snapshotted at a block boundary), then a left-padded batch of two prompts that
share its first blocks is served from it (KV gathered from the pool, the snapshot restored, the rows' states
stacked) and each row's first-step logits are compared with one bare forward over the same tokens. A difference
beyond the float tolerance, a probe row that was not served from cache, or an exception makes the runtime run
uncached with the reason (``ModelRuntime``), naming the installed versions. The paged engine's path has its own
probe, run when the engine is first made (``engine.runtime``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine import contiguous
from engine.generate_checks import merged_config
from engine.hybrid.probe import tolerance
from engine.media.inputs import MediaCall
from engine.versions import label

if TYPE_CHECKING:
    from engine.runtime import ModelRuntime

NAMESPACE = "prefixcache-load-check"  # the probe's requests' namespace (the cache is dropped after it anyway)
SHARED_BLOCKS = 2  # blocks the probe's prompts share
TAILS = (3, 6)  # the second call's rows: the shared blocks, then this many tokens of their own


def contiguous_difference(rt: ModelRuntime, seed: int = 0) -> tuple[float, str | None]:
    """Run the probe (module docstring) through ``rt``'s contiguous path: the largest first-step logit difference
    from the bare model, relative to the logits' scale, and a reason when the probe did not exercise the path (a
    row not served from cache). Changes ``rt``'s cache (the caller drops it after)."""
    model = rt.model
    bs = rt.block_size
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    gen = torch.Generator().manual_seed(seed)
    device = rt.device
    shared = SHARED_BLOCKS * bs
    first = torch.randint(0, vocab, (shared + 3,), generator=gen)
    rows = [torch.cat([first[:shared], torch.randint(0, vocab, (t,), generator=gen)]) for t in TAILS]
    kwargs = {"max_new_tokens": 1, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    gc, why = merged_config(model, kwargs)
    if gc is None:
        return 0.0, f"the probe's generation settings are refused: {why}"
    with torch.inference_mode():
        contiguous.generate(rt, first[None].to(device), None, gc, [NAMESPACE], kwargs, [[shared]])
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = r
            mask[i, width - len(r) :] = 1
        out, stats = contiguous.generate(rt, ids.to(device), mask.to(device), gc, [NAMESPACE] * len(rows), kwargs, None)
        missed = [i for i, s in enumerate(stats) if s.cached_tokens < shared]
        if missed:
            return 0.0, f"the probe's rows {missed} were not served from the prompt stored before them"
        diff = 0.0
        for i, r in enumerate(rows):
            ref = model(input_ids=r[None].to(device)).logits[0, -1].float()
            got = out.logits[0][i].float()
            diff = max(diff, float((got - ref).abs().max() / ref.abs().max().clamp_min(1.0)))
    return diff, None


def contiguous_reason(rt: ModelRuntime) -> str | None:
    """Why ``rt``'s contiguous cached path must not be used on this install (the probe's difference beyond
    tolerance, a probe row not served from cache, or the probe's exception), or None. Changes ``rt``'s cache (the
    caller drops it after)."""
    try:
        diff, why = contiguous_difference(rt)
    except Exception as exc:  # a path that raises on this install: uncached, with what it raised
        return f"the check at load raised {type(exc).__name__}: {exc} ({label()})"
    if why is not None:
        return f"{why} ({label()})"
    tol = tolerance(rt.model)
    if diff > tol:
        return (
            f"the check at load found its cached first-step logits {diff:.1e} (relative) from the bare model's, "
            f"beyond {tol:.0e} ({label()})"
        )
    return None


IMAGE_NAMESPACE = "prefixcache-image-check"  # the image check's requests' namespace: never a caller's


def image_reason(rt: ModelRuntime, input_ids: torch.Tensor, mask: torch.Tensor, media: MediaCall) -> str | None:
    """The check of the image path, on a model's first call with images (``ModelRuntime.image_check``): the
    call's batch goes through the contiguous path twice in a namespace of its own (a miss: the images' encoder
    outputs handed to the model; then a hit through them: their cached KV and positions), and each time its
    first-step logits are compared with one bare forward over the same inputs. Returns why the image path must
    not be used on this install (a difference beyond tolerance, a probe that raised), or None. Changes the cache:
    the probe's blocks stay, in its namespace."""
    model = rt.model
    kwargs = {"max_new_tokens": 1, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    gc, why = merged_config(model, kwargs)
    if gc is None:
        return f"the image check's generation settings are refused: {why}"
    names = [IMAGE_NAMESPACE] * input_ids.shape[0]
    try:
        with torch.inference_mode():
            ref = model(input_ids=input_ids, attention_mask=mask, **media.kwargs).logits[:, -1].float()
            diff = 0.0
            for _ in range(2):  # a miss, then a hit through the images
                out, _ = contiguous.generate(rt, input_ids, mask, gc, names, kwargs, None, media)
                got = out.logits[0].float()
                scale = ref.abs().amax(dim=-1).clamp_min(1.0)
                diff = max(diff, float(((got - ref).abs().amax(dim=-1) / scale).max()))
    except Exception as exc:  # a path that raises on this install: uncached, with what it raised
        return f"the check of the image path raised {type(exc).__name__}: {exc} ({label()})"
    tol = tolerance(model)
    if diff > tol:
        return (
            f"the check of the image path found its cached first-step logits {diff:.1e} (relative) from the bare "
            f"model's, beyond {tol:.0e} ({label()})"
        )
    return None
