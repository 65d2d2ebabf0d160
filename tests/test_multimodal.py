"""Prompts with images through ``PrefixCachedModel.generate``, against the bare model on the same inputs: greedy
tokens equal and first-step logits within float tolerance on a miss, on hits that end before, inside, between and
after images, and on left-padded batches whose rows hold different numbers of images. Two images behind the same
placeholder ids never hit each other's blocks; the vision tower runs once per image while its output is kept."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from vlm_testutil import LLAVA_IMAGE, QWEN_IMAGE, llava_image, qwen_image, tiny_llava, tiny_qwen_vl

from engine import PrefixCachedModel, UncachedCallWarning
from engine.media.families import inner

BS = 4
KW = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_logits=True)


@dataclass(frozen=True)
class Image:
    seed: int
    h: int = 4  # Qwen-VL: patches (2x2 merged into h*w/4 tokens)
    w: int = 6


class Family:
    """A model family with the processor's layout of its inputs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.model = tiny_llava() if name == "llava" else tiny_qwen_vl(name)
        self.image_id = LLAVA_IMAGE if name == "llava" else QWEN_IMAGE

    def run(self, img: Image) -> list[int]:
        return [self.image_id] * 4 if self.name == "llava" else qwen_image(img.h, img.w, img.seed)[2]

    def inputs(self, rows: Sequence[Sequence[int | Image]]) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Left-padded ids, mask and media kwargs of ``rows`` (token ids and images, in order)."""
        flat, pixels, grids = [], [], []
        for row in rows:
            ids: list[int] = []
            for part in row:
                if isinstance(part, Image):
                    ids += self.run(part)
                    if self.name == "llava":
                        pixels.append(llava_image(part.seed))
                    else:
                        pv, grid, _ = qwen_image(part.h, part.w, part.seed)
                        pixels.append(pv)
                        grids.append(grid)
                else:
                    ids.append(part)
            flat.append(ids)
        width = max(len(r) for r in flat)
        ids_t = torch.zeros((len(flat), width), dtype=torch.long)
        mask = torch.zeros_like(ids_t)
        for i, r in enumerate(flat):
            ids_t[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        kw: dict = {}
        if pixels:
            kw["pixel_values"] = torch.cat(pixels)
        if grids:
            kw["image_grid_thw"] = torch.cat(grids)
        if self.name != "llava":
            kw["mm_token_type_ids"] = (ids_t == QWEN_IMAGE).long()
        return ids_t, mask, kw


FAMILIES = ["llava", "qwen2_vl", "qwen2_5_vl"]


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request) -> Family:
    return Family(request.param)


def wrap(fam: Family, **kw) -> PrefixCachedModel:
    pcm = PrefixCachedModel(fam.model, block_size=BS, max_cached_tokens=kw.pop("max_cached_tokens", 512), **kw)
    assert pcm.runtime.load_check_reason is None
    return pcm


def compare(fam: Family, pcm: PrefixCachedModel, rows: Sequence[Sequence[int | Image]]) -> list[int]:
    """The wrapper's and the bare model's generate on ``rows``: equal tokens, close logits; returns each row's
    cached tokens. The call must be served cached (no UncachedCallWarning)."""
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


SYS = list(range(10, 19))  # 9 tokens: the image's first placeholder falls inside block 2
Q1, Q2, Q3 = [30, 31, 32, 33, 34], [30, 31, 40, 41, 42, 43, 44], [50, 51, 52]


def first_placeholder(fam: Family, before: int) -> int:
    return before if fam.name == "llava" else before + 1  # Qwen's run opens with a vision-start token


def test_miss_then_hits_before_between_and_after_images(fam: Family):
    pcm = wrap(fam)
    a, b = Image(1), Image(2)
    run = len(fam.run(a))
    assert compare(fam, pcm, [[*SYS, a, *Q1]]) == [0]
    # the same image: served through it, into the common part of the question
    (hit,) = compare(fam, pcm, [[*SYS, a, *Q2]])
    assert hit == (len(SYS) + run + 2) // BS * BS
    # another image behind the same placeholder ids: nothing from the block holding its first placeholder on
    (other,) = compare(fam, pcm, [[*SYS, b, *Q1]])
    assert other == first_placeholder(fam, len(SYS)) // BS * BS
    # two images: the match ends between them (the second is new here), then after both
    assert compare(fam, pcm, [[*SYS, a, *Q1, b, *Q3]])[0] >= (len(SYS) + run) // BS * BS
    (both,) = compare(fam, pcm, [[*SYS, a, *Q1, b, *Q3, 60]])
    assert both == (len(SYS) + 2 * run + len(Q1) + len(Q3)) // BS * BS
    # an image first, a prompt that starts with it
    assert compare(fam, pcm, [[a, *Q3]]) == [0]
    assert compare(fam, pcm, [[a, *Q3, 61, 62]])[0] == (run + len(Q3)) // BS * BS
    assert pcm.cache_stats()["encoder_cache_misses"] == 2  # each image went through the tower once


def test_batch_rows_with_different_images(fam: Family):
    pcm = wrap(fam)
    a, b, c = Image(3), Image(4, 2, 4), Image(5)
    rows = [[*SYS, a, *Q1], [*SYS, b, *Q2, c, *Q3], [*SYS, *Q3]]
    first = compare(fam, pcm, rows)
    assert first[0] == 0
    again = compare(fam, pcm, [[*r, 70] for r in rows])
    assert all(x >= len(r) - BS for x, r in zip(again, [fam.inputs([r])[0][0] for r in rows]))


def test_a_match_that_ends_inside_an_image(fam: Family):
    """The pool evicts the tail of a cached image prompt; the next one is served up to inside the image and its
    suffix gets the rest of the image's features."""
    pcm = wrap(fam, max_cached_tokens=6 * BS)
    a = Image(6)
    prompt = [*SYS[:2], a, *Q1]
    assert compare(fam, pcm, [prompt]) == [0]
    compare(fam, pcm, [[90 + i for i in range(17)]])  # takes 5 of the 6 blocks: the image prompt keeps 1
    (hit,) = compare(fam, pcm, [prompt])
    start, stop = first_placeholder(fam, 2), 2 + len(fam.run(a))
    assert start < hit < stop, (start, hit, stop)


def test_the_same_image_after_another_prefix_skips_the_tower(fam: Family, monkeypatch):
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
    assert calls == [] and pcm.cache_stats()["encoder_cache_hits"] == 1
    assert pcm.last_request_stats[0].cached_tokens == 0
    pcm.reset_cache()
    assert pcm.cache_stats()["encoder_cache_items"] == 0


def test_text_only_calls_after_an_image_call_keep_their_positions(fam: Family):
    """M-RoPE models remember the last call's position offset (rope_deltas); a cached text call must not use an
    image call's."""
    pcm = wrap(fam)
    compare(fam, pcm, [[*SYS, Image(8), *Q1]])
    text = [*SYS, *Q1, *Q3]
    compare(fam, pcm, [text])
    compare(fam, pcm, [[*text, 5]])


def test_inputs_that_do_not_fit_their_placeholders_are_refused_cleanly(fam: Family):
    pcm = wrap(fam)
    a = Image(9)
    ids, mask, media = fam.inputs([[*SYS, a, *Q1]])
    cases = {
        "placeholder tokens": (torch.cat([ids[:, :3], torch.tensor([[fam.image_id]]), ids[:, 3:]], 1), media),
        "2 images given": (ids, {**media, "pixel_values": torch.cat([media["pixel_values"]] * 2)}),
    }
    if fam.name != "llava":
        two = {k: torch.cat([media[k]] * 2) for k in ("pixel_values", "image_grid_thw")}
        cases["2 images given"] = (ids, {**media, **two})
        cases["patches"] = (ids, {**media, "pixel_values": media["pixel_values"][:-4]})
    for what, (bad_ids, kw) in cases.items():
        if "mm_token_type_ids" in kw:
            kw = {**kw, "mm_token_type_ids": (bad_ids == QWEN_IMAGE).long()}
        with pytest.raises(ValueError, match=what):
            pcm.generate(bad_ids, attention_mask=torch.ones_like(bad_ids), **kw, **KW)
        cache = pcm.runtime.cache
        cache.check_integrity()
        assert cache.num_active_requests == 0 and cache.num_owned_blocks == 0
    assert compare(fam, pcm, [[*SYS, a, *Q1]]) == [0]  # and the next call is exact


def test_a_prompt_that_ends_with_an_image_runs_uncached():
    fam = Family("llava")
    pcm = wrap(fam)
    ids, mask, media = fam.inputs([[*SYS, Image(1)]])
    with pytest.warns(UncachedCallWarning, match="ends with an image"):
        got = pcm.generate(ids, attention_mask=mask, **media, **KW)
    assert torch.equal(got.sequences, fam.model.generate(ids, attention_mask=mask, **media, **KW).sequences)


def test_the_same_ids_without_the_image_never_serve_an_image_prompt():
    fam = Family("llava")
    pcm = wrap(fam)
    ids, mask, media = fam.inputs([[*SYS, Image(1), *Q1]])
    pcm.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)  # the ids alone, as text
    assert pcm.cache_stats()["blocks_used"] > 0
    (hit,) = compare(fam, pcm, [[*SYS, Image(1), *Q1]])
    assert hit == len(SYS) // BS * BS


def test_images_on_a_family_not_listed_run_uncached_with_the_reason(monkeypatch):
    import engine.media.families as families

    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES[1:])  # as if llava were not listed
    fam = Family("llava")
    pcm = PrefixCachedModel(fam.model, block_size=BS, max_cached_tokens=256)
    ids, mask, media = fam.inputs([[*SYS, Image(1), *Q1]])
    with pytest.warns(UncachedCallWarning, match="images on llava are not cached yet"):
        got = pcm.generate(ids, attention_mask=mask, **media, **KW)
    assert torch.equal(got.sequences, fam.model.generate(ids, attention_mask=mask, **media, **KW).sequences)
    assert pcm.cache_stats()["blocks_used"] == 0


def test_the_disk_tier_serves_an_image_prompt_only_for_that_image(tmp_path):
    """Blocks written through to the disk tier carry their image's content in their keys: after a restart the same
    image is served from disk; another image behind the same placeholder ids is not."""
    fam = Family("qwen2_5_vl")
    prompt = [*SYS, Image(1), *Q1]
    first = wrap(fam, disk_cache=tmp_path)
    compare(fam, first, [prompt])
    first.close()
    again = wrap(fam, disk_cache=tmp_path)
    (hit,) = compare(fam, again, [[*prompt, 77]])
    assert again.last_request_stats[0].tier_tokens == hit == (len(fam.inputs([prompt])[0][0])) // BS * BS
    (other,) = compare(fam, again, [[*SYS, Image(2), *Q1, 77]])
    assert other == first_placeholder(fam, len(SYS)) // BS * BS
    again.close()
