"""Prompts with images through ``PrefixCachedModel.generate`` on every image-text family of ``vlm_zoo``, against the
bare model on the same inputs: greedy tokens equal and every step's logits within float tolerance on a miss, on
hits that end before, inside, between and after images, and on left-padded batches whose rows hold different
numbers of images. Two images behind the same placeholder ids never hit each other's blocks (the cached tokens
stop before the block holding the first placeholder); the vision tower runs once per image while its output is
kept. The expected cached tokens are computed here from the ids (the longest common prefix of equal ids and equal
images, in full blocks)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import pytest
import torch
from vlm_zoo import NAMES, Image, Zoo, build

from engine import PrefixCachedModel, UncachedCallWarning
from engine.media.families import inner

BS = 4
KW = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_logits=True)
CACHED = [n for n in NAMES if n != "paligemma"]  # paligemma's whole prompt attends both ways: see the last test
SYS = list(range(10, 19))  # 9 tokens: an image's first placeholder falls inside block 2 or later
Q1, Q2, Q3 = [30, 31, 32, 33, 34], [30, 31, 40, 41, 42, 43, 44], [50, 51, 52]


@pytest.fixture(scope="module", params=CACHED)
def fam(request) -> Zoo:
    if request.param == "llama4" and _transformers_below(5, 25):
        pytest.skip("transformers 5.24's Llama 4 forward raises in the bare model itself (fixed in 5.25)")
    return build(request.param)


def _transformers_below(major: int, minor: int) -> bool:
    import transformers

    got = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    return got < (major, minor)


def wrap(fam: Zoo, **kw) -> PrefixCachedModel:
    pcm = PrefixCachedModel(fam.model, block_size=BS, max_cached_tokens=kw.pop("max_cached_tokens", 1024), **kw)
    assert pcm.runtime.load_check_reason is None
    return pcm


def compare(fam: Zoo, pcm: PrefixCachedModel, rows: Sequence[Sequence[int | Image]]) -> list[int]:
    """The wrapper's and the bare model's generate on ``rows``: equal tokens, close logits; returns each row's
    cached tokens. The call must be served cached (no UncachedCallWarning) and leave nothing pinned."""
    ids, mask, media = fam.inputs(rows)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncachedCallWarning)
        got = pcm.generate(ids, attention_mask=mask, **media, **KW)
    stats = pcm.last_request_stats
    ref = fam.model.generate(ids, attention_mask=mask, **media, **KW)
    assert torch.equal(got.sequences, ref.sequences), (got.sequences, ref.sequences)
    for a, b in zip(got.logits, ref.logits):
        assert (a - b).abs().max().item() <= 1e-4
    cache = pcm.runtime.cache
    cache.check_integrity()
    assert cache.num_active_requests == 0
    return [s.cached_tokens for s in stats]


def ids_of(fam: Zoo, row: Sequence[int | Image]) -> list[int]:
    return fam.inputs([row])[0][0].tolist()


def first_placeholder(fam: Zoo, row: Sequence[int | Image]) -> int:
    return ids_of(fam, row).index(fam.image_id)


def shared(fam: Zoo, a: Sequence[int | Image], b: Sequence[int | Image]) -> int:
    """Tokens a match of ``b`` may serve after ``a`` was committed: their common prefix (equal ids; the rows'
    images are the same ones wherever their ids agree here), in full blocks, leaving one token."""
    x, y = ids_of(fam, a), ids_of(fam, b)
    n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return min(n // BS, (len(y) - 1) // BS) * BS


def test_miss_then_hits_before_between_and_after_images(fam: Zoo):
    pcm = wrap(fam)
    hybrid = pcm.runtime.hybrid is not None  # served up to a recurrent-state snapshot: at most the KV match
    a, b = Image(1), Image(2)
    first = [*SYS, a, *Q1]
    assert compare(fam, pcm, [first]) == [0]
    # the same image: served through it, into the common part of the question
    second = [*SYS, a, *Q2]
    (hit,) = compare(fam, pcm, [second])
    assert hit <= shared(fam, first, second) and (hybrid or hit == shared(fam, first, second))
    # another image behind the same placeholder ids: nothing from the block holding its first placeholder on
    (other,) = compare(fam, pcm, [[*SYS, b, *Q1]])
    assert other <= first_placeholder(fam, first) // BS * BS
    # two images: the match ends between them (the second is new here), then after both
    both = [*SYS, a, *Q1, b, *Q3]
    compare(fam, pcm, [both])
    (after,) = compare(fam, pcm, [[*both, 60]])
    assert after <= shared(fam, both, [*both, 60]) and (hybrid or after == shared(fam, both, [*both, 60]))
    # a prompt that starts with an image
    assert compare(fam, pcm, [[a, *Q3]]) == [0]
    assert compare(fam, pcm, [[a, *Q3, 61, 62]])[0] <= shared(fam, [a, *Q3], [a, *Q3, 61, 62])


def test_batch_rows_with_different_images(fam: Zoo):
    pcm = wrap(fam)
    a, b, c = Image(3), Image(4, 1 if fam.name in SIZED else 0), Image(5)
    rows = [[*SYS, a, *Q1], [*SYS, b, *Q2, c, *Q3], [*SYS, *Q3]]
    assert compare(fam, pcm, rows)[0] == 0
    again = compare(fam, pcm, [[*r, 70] for r in rows])
    if pcm.runtime.hybrid is None:
        assert again == [shared(fam, r, [*r, 70]) for r in rows]


SIZED = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "glm4v", "mistral3", "llava_next", "llama4", "internvl"}


def test_a_match_that_ends_inside_an_image(fam: Zoo):
    """The pool evicts the tail of a cached image prompt so that what stays ends inside the image: a causal family
    is served up to there (its suffix gets the rest of the image's features), a bidirectional one (Gemma 3 and 4:
    an image's placeholders attend to each other both ways) only up to the image."""
    if fam.name in ("qwen3_5", "lfm2_vl"):
        pytest.skip("hybrid: served up to recurrent-state snapshots, not to wherever the KV ends")
    for lead in range(BS):  # a text lead after which a block boundary falls strictly inside the image
        prompt = [*SYS[: lead + 1], Image(6), *Q1]
        ids = ids_of(fam, prompt)
        start, last = ids.index(fam.image_id), len(ids) - 1 - ids[::-1].index(fam.image_id)
        keep = start // BS + 1  # what stays: up to the block after the one holding the first placeholder
        if start < keep * BS <= last:
            break
    # window groups off: the pool's size in blocks is what this arithmetic needs (tests/test_sliding.py has them)
    probe = wrap(fam, sliding_windows=False)
    compare(fam, probe, [prompt])
    used = probe.cache_stats()["blocks_used"]
    pcm = wrap(fam, max_cached_tokens=used * BS, sliding_windows=False)
    compare(fam, pcm, [prompt])
    compare(fam, pcm, [[90 + i % 50 for i in range((used - keep) * BS - KW["max_new_tokens"] + 1)]])
    (hit,) = compare(fam, pcm, [prompt])
    if fam.name in ("gemma3", "gemma4"):
        assert hit == start // BS * BS
    else:
        assert hit == keep * BS and start < hit, (start, hit)


def test_the_same_image_after_another_prefix_skips_the_tower(fam: Zoo, monkeypatch):
    pcm = wrap(fam)
    calls = []
    tower = inner(fam.model).get_image_features

    @functools.wraps(tower)  # generate reads its signature
    def counted(*args, **kwargs):
        calls.append(1)
        return tower(*args, **kwargs)

    monkeypatch.setattr(inner(fam.model), "get_image_features", counted)
    a = Image(7)
    compare(fam, pcm, [[*SYS, a, *Q1]])
    calls.clear()  # the bare model's reference run calls it too
    ids, mask, media = fam.inputs([[99, 98, 97, a, *Q2]])  # another system prompt: no KV hit on the image
    pcm.generate(ids, attention_mask=mask, **media, **KW)
    assert calls == [] and pcm.cache_stats()["encoder_cache_hits"] >= 1
    assert pcm.last_request_stats[0].cached_tokens == 0
    pcm.reset_cache()
    assert pcm.cache_stats()["encoder_cache_items"] == 0


def test_text_calls_after_an_image_call_keep_their_positions(fam: Zoo):
    """M-RoPE models remember the last call's position offset (rope_deltas); a cached text call must not use an
    image call's."""
    pcm = wrap(fam)
    compare(fam, pcm, [[*SYS, Image(8), *Q1]])
    text = [*SYS, *Q1, *Q3]
    compare(fam, pcm, [text])
    compare(fam, pcm, [[*text, 5]])


def test_inputs_that_do_not_fit_their_placeholders_are_refused_cleanly(fam: Zoo):
    pcm = wrap(fam)
    a = Image(9)
    ids, mask, media = fam.inputs([[*SYS, a, *Q1]])
    extra = torch.cat([ids[:, :3], torch.tensor([[fam.image_id]]), ids[:, 3:]], 1)
    cut = ids[:, first_placeholder(fam, [*SYS, a, *Q1]) + 1 :]
    for bad_ids in (extra, cut):  # a placeholder too many; the image's first one cut away
        kw = {k: (v if v.shape != ids.shape else torch.zeros_like(bad_ids)) for k, v in media.items()}
        with pytest.raises(ValueError, match="placeholder"):
            pcm.generate(bad_ids, attention_mask=torch.ones_like(bad_ids), **kw, **KW)
        cache = pcm.runtime.cache
        cache.check_integrity()
        assert cache.num_active_requests == 0 and cache.num_owned_blocks == 0
    assert compare(fam, pcm, [[*SYS, a, *Q1]]) == [0]  # and the next call is exact


def test_the_disk_tier_serves_an_image_prompt_only_for_that_image(tmp_path):
    """Blocks written through to the disk tier carry their image's content in their keys: after a restart the same
    image is served from disk; another image behind the same placeholder ids is not."""
    fam = build("qwen2_5_vl")
    prompt = [*SYS, Image(1), *Q1]
    first = wrap(fam, disk_cache=tmp_path)
    compare(fam, first, [prompt])
    first.close()
    again = wrap(fam, disk_cache=tmp_path)
    (hit,) = compare(fam, again, [[*prompt, 77]])
    assert again.last_request_stats[0].tier_tokens == hit == shared(fam, prompt, [*prompt, 77])
    (other,) = compare(fam, again, [[*SYS, Image(2), *Q1, 77]])
    assert other == first_placeholder(fam, prompt) // BS * BS
    again.close()


def test_a_prompt_that_ends_with_an_image_runs_uncached():
    fam = build("llava")
    pcm = wrap(fam)
    ids, mask, media = fam.inputs([[*SYS, Image(1)]])
    with pytest.warns(UncachedCallWarning, match="ends with an image"):
        got = pcm.generate(ids, attention_mask=mask, **media, **KW)
    assert torch.equal(got.sequences, fam.model.generate(ids, attention_mask=mask, **media, **KW).sequences)


def test_the_same_ids_without_the_image_never_serve_an_image_prompt():
    fam = build("llava")
    pcm = wrap(fam)
    ids, mask, _ = fam.inputs([[*SYS, Image(1), *Q1]])
    pcm.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)  # the ids alone, as text
    assert pcm.cache_stats()["blocks_used"] > 0
    (hit,) = compare(fam, pcm, [[*SYS, Image(1), *Q1]])
    assert hit == len(SYS) // BS * BS


def test_images_on_a_family_not_listed_run_uncached_with_the_reason(monkeypatch):
    import engine.media.families as families

    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES[1:])  # as if llava were not listed
    fam = build("llava")
    pcm = PrefixCachedModel(fam.model, block_size=BS, max_cached_tokens=256)
    ids, mask, media = fam.inputs([[*SYS, Image(1), *Q1]])
    with pytest.warns(UncachedCallWarning, match="images on llava are not cached yet"):
        got = pcm.generate(ids, attention_mask=mask, **media, **KW)
    assert torch.equal(got.sequences, fam.model.generate(ids, attention_mask=mask, **media, **KW).sequences)
    assert pcm.cache_stats()["blocks_used"] == 0


def test_paligemma_runs_uncached_because_its_prompt_attends_both_ways():
    """PaliGemma's prompt (text and image) is one bidirectional block: no prefix of it can be reused. The check at
    load finds that on text already, and every call runs the bare model."""
    fam = build("paligemma")
    with pytest.warns(UncachedCallWarning, match="check at load"):
        pcm = PrefixCachedModel(fam.model, block_size=BS, max_cached_tokens=256)
    ids, mask, media = fam.inputs([[*SYS, Image(1), *Q1]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncachedCallWarning)
        got = pcm.generate(ids, attention_mask=mask, **media, **KW)
    assert torch.equal(got.sequences, fam.model.generate(ids, attention_mask=mask, **media, **KW).sequences)
    assert pcm.cache_stats()["blocks_used"] == 0


def _one(fam: Zoo, row: Sequence[int | Image]) -> dict:
    """One prompt as a processor gives it (a mapping with input_ids and the media tensors)."""
    ids, mask, media = fam.inputs([row])
    return {"input_ids": ids, "attention_mask": mask, **media}


def test_generate_batch_takes_prompts_with_images_beside_token_lists(fam: Zoo):
    pcm = wrap(fam)
    rows = [[*SYS, Image(1), *Q1], [*SYS, *Q2], [*SYS, Image(1), *Q2]]
    inputs = [_one(fam, rows[0]), ids_of(fam, rows[1]), _one(fam, rows[2])]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncachedCallWarning)
        out = pcm.generate_batch(inputs, max_new_tokens=4, do_sample=False)
    assert list(out) == ["req_0", "req_1", "req_2"]
    for rid, row in zip(out, rows):
        ids, mask, media = fam.inputs([row])
        ref = fam.model.generate(ids, attention_mask=mask, **media, max_new_tokens=4, do_sample=False)
        assert out[rid].prompt_ids == ids[0].tolist()
        assert out[rid].generated_tokens == ref[0, ids.shape[1] :].tolist()
    if pcm.runtime.hybrid is None:
        assert out["req_2"].cached_tokens == shared(fam, rows[0], rows[2])
    pcm.runtime.cache.check_integrity()


def test_score_takes_contexts_with_images(fam: Zoo):
    """Log-likelihoods of continuations after an image context equal the bare model's forward; the second
    continuation of the same context is served from cache (not on a hybrid model: scored uncached there)."""
    pcm = wrap(fam)
    ctx = [*SYS, Image(2), *Q1]
    conts = [[60, 61, 62], [63, 64]]
    reqs = [(_one(fam, ctx), c) for c in conts] + [(ids_of(fam, [*SYS, *Q2]), [65])]
    hybrid = pcm.runtime.hybrid is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if hybrid else "error", UncachedCallWarning)
        got = pcm.score(reqs, token_logprobs=True)
    for r, (context, cont) in zip(got, reqs):
        if isinstance(context, dict):
            ids = torch.cat([context["input_ids"], torch.tensor([cont])], dim=1)
            media = {k: v for k, v in context.items() if k not in ("input_ids", "attention_mask")}
            for key in ("token_type_ids", "mm_token_type_ids"):
                if key in media:
                    media[key] = torch.cat([media[key], torch.zeros((1, len(cont)), dtype=media[key].dtype)], 1)
        else:
            ids, media = torch.tensor([context + cont]), {}
        with torch.no_grad():
            logits = fam.model(input_ids=ids, **media).logits[0, -len(cont) - 1 : -1]
        ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(cont)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(r.token_logprobs), ref, atol=1e-4), (r.token_logprobs, ref)
    n_ctx = len(ids_of(fam, ctx))
    assert got[1].cached_tokens == (0 if hybrid else (n_ctx - 1) // BS * BS)
    pcm.runtime.cache.check_integrity()
    assert pcm.runtime.cache.num_active_requests == 0


def test_an_image_path_that_differs_from_the_bare_model_is_found_and_images_run_uncached(monkeypatch):
    """The first call with images checks the image path against the bare model (a miss and a hit, in a namespace
    of its own). Simulated drift: the model now takes an image's features in another order than the cache hands
    them over. The check finds it, images run uncached with the reason from then on (text calls stay cached),
    and the outputs are the bare model's."""
    import engine.media.families as families

    fam = build("qwen2_5_vl")
    pcm = wrap(fam)
    outputs = families.Features.outputs
    monkeypatch.setattr(families.Features, "outputs", lambda self, parts: _flipped(outputs, self, parts))
    ids, mask, media = fam.inputs([[*SYS, Image(1), *Q1]])
    with pytest.warns(UncachedCallWarning, match="check of the image path"):
        got = pcm.generate(ids, attention_mask=mask, **media, **KW)
    assert torch.equal(got.sequences, fam.model.generate(ids, attention_mask=mask, **media, **KW).sequences)
    assert "check of the image path" in pcm.last_uncached_reason
    stats = pcm.cache_stats()
    assert stats["lookups"] == 0 and stats["encoder_cache_misses"] == 0  # the check's own counts are taken back
    compare(fam, pcm, [[*SYS, *Q1]])  # text is still cached


def _flipped(outputs, self, parts):
    """The features of ``parts`` with their rows in reverse order."""
    out = outputs(self, parts)
    out.pooler_output = [t.flip(0) for t in out.pooler_output]
    return out


def test_the_encoder_cache_is_dropped_with_the_kv_when_the_weights_change():
    from engine import StaleCacheWarning

    fam = build("llava")
    pcm = wrap(fam)
    compare(fam, pcm, [[*SYS, Image(1), *Q1]])
    assert pcm.cache_stats()["encoder_cache_items"] == 1
    with torch.no_grad():
        inner(fam.model).multi_modal_projector.linear_1.weight.mul_(1.01)  # the image features change
    with pytest.warns(StaleCacheWarning):
        compare(fam, pcm, [[*SYS, Image(1), *Q2]])  # exact: not the old features, not the old KV
    assert pcm.last_request_stats[0].cached_tokens == 0
    assert pcm.cache_stats()["encoder_cache_items"] == 1  # the new output only


def test_a_grid_that_does_not_match_the_pixels_is_refused():
    fam = build("qwen2_5_vl")
    pcm = wrap(fam)
    ids, mask, media = fam.inputs([[*SYS, Image(1), *Q1]])
    with pytest.raises(ValueError, match="image_grid_thw gives 24 patches for 1 images, but pixel_values holds 20"):
        pcm.generate(ids, attention_mask=mask, **{**media, "pixel_values": media["pixel_values"][:20]}, **KW)
    grid = media["image_grid_thw"].clone()
    grid[0, 1] = 2  # 12 patches: 3 placeholders where the prompt holds 6
    with pytest.raises(ValueError, match="row 0 holds 6 image placeholder tokens"):
        pcm.generate(
            ids,
            attention_mask=mask,
            **{**media, "image_grid_thw": grid, "pixel_values": media["pixel_values"][:12]},
            **KW,
        )
    assert pcm.runtime.cache.num_active_requests == 0
