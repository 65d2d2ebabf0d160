"""``prefixcache serve`` on an image-text model (the ``tiny-vlm`` preset) with the openai client: a 4-turn chat with
an image in turns 1 and 3 gets the bare model's replies and the cached tokens a brute-force record of what was
committed says; images that are not data: URLs, not images, too large, or sent to a text model get a 400."""

from __future__ import annotations

import base64
import io
import uuid

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from serve_testutil import server_thread

from engine.media.processor import load_processor
from engine.models import build_preset
from engine.runtime import ModelRuntime, RuntimeConfig
from engine.serve.app import create_app
from engine.serve.backend import LocalBackend

BS = 16
MAX_TOKENS = 8


def png_url(seed: int, w: int = 84, h: int = 56, fmt: str = "PNG") -> str:
    pixels = (np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def decode(url: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


@pytest.fixture(scope="module")
def vlm():
    runtime = ModelRuntime.load("tiny-vlm", RuntimeConfig(max_cached_tokens=8192, block_size=BS))
    assert runtime.processor is not None
    backend = LocalBackend(runtime, "tiny-vlm", use_engine=True)
    with server_thread(create_app(backend, default_max_tokens=MAX_TOKENS, max_image_bytes=100_000)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, runtime, backend


@pytest.fixture(scope="module")
def bare():
    model, tok = build_preset("tiny-vlm")
    return model, load_processor("tiny-vlm", tok)


def reference(bare, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The bare model's prompt ids and greedy reply ids for OpenAI-style ``messages``."""
    model, proc = bare
    images, rendered = [], []
    for m in messages:
        if isinstance(m["content"], str):
            rendered.append(m)
            continue
        parts = []
        for p in m["content"]:
            if p["type"] == "image_url":
                images.append(decode(p["image_url"]["url"]))
                parts.append({"type": "image"})
            else:
                parts.append(p)
        rendered.append({"role": m["role"], "content": parts})
    text = proc.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=[text], images=images)
    out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    reply = out[0, len(prompt) :].tolist()
    eos = model.generation_config.eos_token_id
    return prompt, reply[: reply.index(eos) + 1] if eos in reply else reply


def expected_cached(prompt: list[int], committed: list[list[int]]) -> int:
    """Longest common prefix with a committed sequence, in full blocks, at most all but the last token (the turns'
    images sit at the same places, so equal ids there mean equal images)."""
    best = 0
    for c in committed:
        n = next((i for i, (a, b) in enumerate(zip(prompt, c)) if a != b), min(len(prompt), len(c)))
        best = max(best, n // BS)
    return min(best, (len(prompt) - 1) // BS) * BS


def test_a_four_turn_chat_with_images_in_turns_1_and_3(vlm, bare):
    client, runtime, backend = vlm
    salt = uuid.uuid4().hex[:8]
    a, b = png_url(1), png_url(2, 112, 84)
    turns = [
        [{"type": "image_url", "image_url": {"url": a}}, {"type": "text", "text": "What is in the picture?"}],
        "And its colours?",
        [{"type": "text", "text": "Compare with this one:"}, {"type": "image_url", "image_url": {"url": b}}],
        "Which is brighter?",
    ]
    messages: list[dict] = [{"role": "system", "content": "You answer briefly."}]
    committed: list[list[int]] = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        prompt, reply = reference(bare, messages)
        r = client.chat.completions.create(
            model="tiny-vlm", messages=messages, max_tokens=MAX_TOKENS, extra_body={"cache_salt": salt}
        )
        text = r.choices[0].message.content
        assert text == bare[1].tokenizer.decode(reply, skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(prompt)
        assert r.usage.prompt_tokens_details.cached_tokens == expected_cached(prompt, committed)
        committed.append(prompt + reply)
        messages.append({"role": "assistant", "content": text})
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    # another tenant: nothing shared, the same reply
    again = client.chat.completions.create(
        model="tiny-vlm", messages=messages[:2], max_tokens=MAX_TOKENS, extra_body={"cache_salt": "other"}
    )
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert backend.worker.run_exclusive(lambda: runtime.cache.num_active_requests).result(timeout=60) == 0
    runtime.cache.check_integrity()


def test_another_image_behind_the_same_placeholders_is_not_served_from_the_first(vlm, bare):
    client, _, _ = vlm
    salt = uuid.uuid4().hex[:8]
    first = None
    for seed in (3, 4):  # same size: the same placeholder ids
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(seed)}}]}]
        prompt, reply = reference(bare, messages)
        r = client.chat.completions.create(
            model="tiny-vlm", messages=messages, max_tokens=MAX_TOKENS, extra_body={"cache_salt": salt}
        )
        assert r.choices[0].message.content == bare[1].tokenizer.decode(reply, skip_special_tokens=True)
        first = first or prompt
        start = prompt.index(bare[1].image_token_id)
        assert prompt == first
        assert r.usage.prompt_tokens_details.cached_tokens <= start // BS * BS


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://example.com/cat.png", "not fetched"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "not a decodable PNG"),
        ("data:image/gif;base64,R0lGODlh", "expected data:image/png"),
        (png_url(5, fmt="JPEG").replace("image/jpeg", "image/png"), "is JPEG"),
        (png_url(6, 400, 400), "larger than this server's limit"),
    ],
)
def test_bad_images_get_a_400_naming_the_part(vlm, url, message):
    client, runtime, backend = vlm
    content = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]
    with pytest.raises(openai.BadRequestError, match=message) as err:
        client.chat.completions.create(model="tiny-vlm", messages=[{"role": "user", "content": content}], max_tokens=2)
    assert "messages[0].content[1].image_url" in str(err.value)
    assert backend.worker.run_exclusive(lambda: runtime.cache.num_active_requests).result(timeout=60) == 0


def test_an_image_sent_to_a_text_model_gets_a_400():
    runtime = ModelRuntime.load("tiny", RuntimeConfig(max_cached_tokens=1024, block_size=BS))
    backend = LocalBackend(runtime, "tiny", use_engine=False)
    with server_thread(create_app(backend)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        content = [{"type": "image_url", "image_url": {"url": png_url(1)}}]
        with pytest.raises(openai.BadRequestError, match="takes no images"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}])
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.choices[0].message.content is not None


def test_the_processor_refuses_a_count_mismatch():
    _, tok = build_preset("tiny-vlm")
    proc = load_processor("tiny-vlm", tok)
    with pytest.raises(ValueError, match="1 images' placeholders"):
        proc(text=["<|vision_start|><|image_pad|><|vision_end|>hi"], images=[])
    got = proc(text=["x"], images=None)
    assert torch.equal(got["input_ids"], torch.tensor([tok("x", add_special_tokens=False)["input_ids"]]))
