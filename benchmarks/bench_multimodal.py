"""Prompts with images: time to first token on ``small-vlm`` (Qwen2.5-VL-shaped, random weights) for a prompt of
over a thousand tokens that is mostly one image, cached against bare, and every image-text family tried.

    python benchmarks/bench_multimodal.py               # small-vlm, 3 rounds (about 2 minutes)
    python benchmarks/bench_multimodal.py --families    # also each family of tests/vlm_zoo.py (about a minute)

Per round (a fresh cache): the bare model's first token on question 1 about image A (the vision tower and the
whole prompt); the wrapper's first call with images (another picture: it runs the image path's check first,
timed on its own); the wrapper's on question 1 about image A (a miss); question 2 about image A (served from cache up to the
question); question 1 about image B, which has the same size and so the same placeholder ids (image tokens
served from cache must be 0); question 1 about image A after another system prompt (the vision tower must not
run: its output is kept by content id). TTFT is ``generate(max_new_tokens=1)``'s wall time, the image already
preprocessed; every case's greedy reply (``--reply-tokens``) is compared with the bare model's. Medians over
``--rounds``. Writes benchmarks/results/bench_multimodal.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _meta

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "bench_multimodal.json"
SYSTEM = "You describe images for a catalogue. Answer in one short sentence, naming the main object and colour."
OTHER_SYSTEM = "You are a careful assistant for visually impaired users; describe what matters first."
QUESTIONS = ("What is the main object in this picture?", "What colours dominate the background?")


def picture(seed: int, side: int) -> Any:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)  # a blocky picture, resized: not pure noise
    return Image.fromarray(base).resize((side, side), Image.Resampling.BILINEAR)


def inputs(proc: Any, system: str, image: Any, question: str) -> dict[str, Any]:
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
    ]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return proc(text=[text], images=[image])


def timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def one_round(model: Any, proc: Any, side: int, reply_tokens: int) -> dict[str, Any]:
    import torch

    from engine import PrefixCachedModel
    from engine.media.families import inner

    a, b = picture(1, side), picture(2, side)
    pcm = PrefixCachedModel(model, block_size=16, max_cached_tokens=16384)
    tower_calls: list[int] = []
    tower = inner(model).get_image_features

    @functools.wraps(tower)
    def counted(*args: Any, **kwargs: Any) -> Any:
        tower_calls.append(1)
        return tower(*args, **kwargs)

    cases = {
        "miss": inputs(proc, SYSTEM, a, QUESTIONS[0]),
        "same_image": inputs(proc, SYSTEM, a, QUESTIONS[1]),
        "other_image": inputs(proc, SYSTEM, b, QUESTIONS[0]),
        "other_system": inputs(proc, OTHER_SYSTEM, a, QUESTIONS[0]),
    }
    image_id = proc.image_token_id
    row: dict[str, Any] = {"prompt_tokens": int(cases["miss"]["input_ids"].shape[1])}
    row["image_tokens"] = int((cases["miss"]["input_ids"] == image_id).sum())
    with torch.inference_mode():
        row["bare_ttft_s"], _ = timed(lambda: model.generate(**cases["miss"], max_new_tokens=1, do_sample=False))
        # the wrapper's first call with images runs the image path's check (a miss and a hit, against the bare
        # model) before it: timed here on a third picture, apart from the cases
        warm = inputs(proc, OTHER_SYSTEM, picture(3, side), QUESTIONS[1])
        row["first_image_call_s"], _ = timed(lambda: pcm.generate(**warm, max_new_tokens=1, do_sample=False))
        inner(model).get_image_features = counted
        try:
            for name, inp in cases.items():
                tower_calls.clear()
                ttft, _ = timed(lambda inp=inp: pcm.generate(**inp, max_new_tokens=1, do_sample=False))
                stats = pcm.last_request_stats[0]
                first = int((inp["input_ids"][0] == image_id).nonzero()[0])
                row[name] = {
                    "ttft_s": ttft,
                    "cached_tokens": stats.cached_tokens,
                    "image_tokens_cached": max(0, min(stats.cached_tokens, first + row["image_tokens"]) - first),
                    "tower_calls": len(tower_calls),
                }
        finally:
            del inner(model).get_image_features
        exact = True
        check = PrefixCachedModel(model, block_size=16, max_cached_tokens=16384)
        check.generate(**warm, max_new_tokens=1, do_sample=False)  # its image check, before the compared calls
        for inp in cases.values():  # the replies, cached (after the previous cases) against bare
            got = check.generate(**inp, max_new_tokens=reply_tokens, do_sample=False)
            ref = model.generate(**inp, max_new_tokens=reply_tokens, do_sample=False)
            exact = exact and torch.equal(got, ref)
        row["replies_equal"] = exact
    return row


def families() -> list[dict[str, Any]]:
    """Each family of tests/vlm_zoo.py: whether its images are cached, and on a miss, a hit through the image and
    another image behind the same placeholders: greedy tokens equal to the bare model's and what was cached. The
    families transformers maps to image-text-to-text that the zoo does not build are listed as not tried."""
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    sys.path.insert(0, str(ROOT / "tests"))
    import vlm_zoo as zoo

    from engine import PrefixCachedModel, UncachedCallWarning
    from engine.media.families import names

    kw = dict(max_new_tokens=4, do_sample=False)
    sys_ids, q1, q2 = list(range(10, 19)), [30, 31, 32, 33, 34], [30, 31, 40, 41, 42]
    rows = []
    for name in zoo.NAMES:
        z = zoo.build(name)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            pcm = PrefixCachedModel(z.model, block_size=4, max_cached_tokens=4096, on_unsupported="passthrough")
            outs = []
            prompts = [[*sys_ids, zoo.Image(1), *q1], [*sys_ids, zoo.Image(1), *q2], [*sys_ids, zoo.Image(2), *q1]]
            prompts.append([*prompts[1], 50])  # a hybrid model is served up to a state snapshot: the one at q2's end
            for row in prompts:
                ids, mask, media = z.inputs([row])
                out = pcm.generate(ids, attention_mask=mask, **media, **kw)
                ref = z.model.generate(ids, attention_mask=mask, **media, **kw)
                stats = pcm.last_request_stats
                first = int((ids[0] == z.image_id).nonzero()[0])
                cached = stats[0].cached_tokens if stats else 0
                outs.append((bool(torch.equal(out, ref)), cached, max(0, cached - first)))
        reasons = [str(w.message) for w in got if issubclass(w.category, UncachedCallWarning)]
        rows.append(
            {
                "family": name,
                "status": "uncached" if reasons else "cached",
                "reason": reasons[0].split(": ", 2)[-1] if reasons else None,
                "hybrid": pcm.runtime.hybrid is not None,
                "exact": all(e for e, _, _ in outs),
                "hit_tokens": outs[1][1] if pcm.runtime.hybrid is None else outs[3][1],
                "other_image_tokens_cached": outs[2][2],
            }
        )
        print(f"{name:16s} {rows[-1]['status']:9s} exact={rows[-1]['exact']} hit={outs[1][1]} other={outs[2][2]}")
    tried = set(zoo.NAMES)
    listed = set(names())
    for name in sorted(set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) - tried):
        status = "listed, not tried" if name in listed else "not tried"
        rows.append({"family": name, "status": status, "reason": None})
    return rows


def table_md(rows: list[dict[str, Any]]) -> str:
    """The family table as markdown: the tried families, then the rest of transformers' mapping in one line."""
    lines = [
        "| family | images | greedy tokens equal bare (miss, hit, other image) | hit through the image: tokens "
        "cached | another image, same ids: its tokens cached |",
        "| --- | --- | --- | ---: | ---: |",
    ]
    for r in rows:
        if "not tried" in r["status"]:
            continue
        status = r["status"] if r["reason"] is None else f"{r['status']}: {r['reason']}"
        status += " (hybrid: the hit is the third prompt's, served up to a state snapshot)" if r.get("hybrid") else ""
        exact = "yes" if r["exact"] else "**no**"
        lines.append(f"| `{r['family']}` | {status} | {exact} | {r['hit_tokens']} | {r['other_image_tokens_cached']} |")
    listed = [r["family"] for r in rows if r["status"] == "listed, not tried"]
    rest = [r["family"] for r in rows if r["status"] == "not tried"]
    lines.append("")
    lines.append(
        f"Listed with a tried sibling but not built here (their images are cached as the sibling's): "
        f"{', '.join(f'`{n}`' for n in listed)}. Not tried ({len(rest)} more model types transformers maps to "
        f"image-text-to-text; their images run the bare model, with an `UncachedCallWarning`): "
        f"{', '.join(f'`{n}`' for n in rest)}."
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--side", type=int, default=896, help="image side in pixels (896: 1,024 image tokens)")
    ap.add_argument("--reply-tokens", type=int, default=8)
    ap.add_argument("--families", action="store_true", help="also the family table (tests/vlm_zoo.py)")
    ap.add_argument("--json", type=Path, default=OUT)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import torch

    from engine.media.processor import load_processor
    from engine.models import build_preset

    torch.set_num_threads(max(1, torch.get_num_threads()))
    meta = _meta.begin()
    model, tok = build_preset("small-vlm")
    proc = load_processor("small-vlm", tok)
    rounds = []
    for r in range(args.rounds):
        rounds.append(one_round(model, proc, args.side, args.reply_tokens))
        x = rounds[-1]
        print(
            f"round {r + 1}: {x['prompt_tokens']} tokens ({x['image_tokens']} image)  bare {x['bare_ttft_s']:.3f} s  "
            f"miss {x['miss']['ttft_s']:.3f} s  same image {x['same_image']['ttft_s']:.3f} s  "
            f"other image {x['other_image']['ttft_s']:.3f} s  other system {x['other_system']['ttft_s']:.3f} s  "
            f"exact={x['replies_equal']}"
        )
    med = {"bare_ttft_s": statistics.median(x["bare_ttft_s"] for x in rounds)}
    med["first_image_call_ratio"] = statistics.median(x["first_image_call_s"] / x["bare_ttft_s"] for x in rounds)
    for case in ("miss", "same_image", "other_image", "other_system"):
        med[case] = {
            "ttft_s": statistics.median(x[case]["ttft_s"] for x in rounds),
            "ttft_ratio": statistics.median(x[case]["ttft_s"] / x["bare_ttft_s"] for x in rounds),
            "cached_tokens": rounds[-1][case]["cached_tokens"],
            "image_tokens_cached": max(x[case]["image_tokens_cached"] for x in rounds),
            "tower_calls": max(x[case]["tower_calls"] for x in rounds),
        }
    med["prompt_tokens"], med["image_tokens"] = rounds[0]["prompt_tokens"], rounds[0]["image_tokens"]
    med["replies_equal"] = all(x["replies_equal"] for x in rounds)
    print(
        f"median TTFT / bare: miss {med['miss']['ttft_ratio']:.2f}x  same image {med['same_image']['ttft_ratio']:.3f}x"
        f"  other image {med['other_image']['ttft_ratio']:.2f}x  other system {med['other_system']['ttft_ratio']:.2f}x"
    )
    out: dict[str, Any] = {
        "model": "small-vlm",
        "rounds": rounds,
        "median": med,
        "settings": vars(args) | {"json": None},
    }
    if args.families:
        out["families"] = families()
        out["families_table_md"] = table_md(out["families"])
    out["meta"] = _meta.end(meta)
    args.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
