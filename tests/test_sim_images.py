"""Scenarios whose chat turns carry images: the simulator keys an image's blocks by its content id as the model
side does, checked against a brute-force reference that compares (token, image) per block; ``explain`` names
the request whose image another one displaced; bad ``images`` entries are refused naming the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_testutil import one_line_error
from typer.testing import CliRunner

from prefixcache.cli import app
from prefixcache.core.errors import InputError
from prefixcache.sim.policy import Capacity
from prefixcache.sim.replay import replay
from prefixcache.sim.requests import from_scenario
from prefixcache.workload.render import IMAGE_PAD, ByteRenderer, Conversations, synthetic_reply
from prefixcache.workload.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "image_chat.yaml"


def reference(scenario, bs: int) -> list[int]:
    """Cached tokens per request, unlimited capacity: leading full blocks equal to an earlier committed sequence's
    in tokens AND in the image each block's placeholders belong to (same namespace), leaving one token."""
    conv, r = Conversations(), ByteRenderer()
    seen: list[tuple[str, list[tuple[int, str | None]]]] = []
    out = []
    for i, req in enumerate(scenario.requests):
        ids, spans = conv.prompt_spans(req, r)
        owner: list[str | None] = [None] * len(ids)
        for a, b, name in spans:
            owner[a:b] = [name] * (b - a)
        reply = list(synthetic_reply(scenario.seed, i, req.max_new_tokens or scenario.max_new_tokens).encode())
        labels = list(zip(ids, owner))
        best = 0
        for ns, seq in seen:
            if ns != req.namespace:
                continue
            n = 0
            while (n + 1) * bs <= min(len(seq), len(labels)):
                blk = slice(n * bs, (n + 1) * bs)
                images_a = {o for _, o in labels[blk]} - {None}
                images_b = {o for _, o in seq[blk]} - {None}
                if [t for t, _ in labels[blk]] != [t for t, _ in seq[blk]] or images_a != images_b:
                    break
                n += 1
            best = max(best, n)
        out.append(min(best, (len(ids) - 1) // bs) * bs)
        full = labels + [(t, None) for t in reply[:-1]]
        seen.append((req.namespace, full))
        conv.add_reply(req, synthetic_reply(scenario.seed, i, req.max_new_tokens or scenario.max_new_tokens))
    return out


@pytest.mark.parametrize("bs", [4, 16, 64])
def test_image_chat_equals_the_reference(bs):
    sc = load_scenario(SCENARIO)
    got = replay(from_scenario(sc, bs), Capacity(None))
    cached = [row.cached_tokens for row in got.rows]
    assert cached == reference(sc, bs)
    # cleo's photo (request 2) has the catalogue photo's placeholder ids, and is not served from it
    ids, _ = Conversations().prompt_spans(sc.requests[2], ByteRenderer())
    assert cached[2] <= ids.index(IMAGE_PAD) // bs * bs < cached[1]


def test_explain_names_the_displaced_image(tmp_path):
    out = tmp_path / "why.json"
    r = CliRunner().invoke(app, ["explain", str(SCENARIO), "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "Another image behind the same placeholder ids" in r.output
    swaps = json.loads(out.read_text())["image_swaps"]
    assert swaps == [
        {
            "request": 2,
            "position": swaps[0]["position"],
            "image": "photo-from-cleo",
            "partner": 0,
            "partner_image": "catalogue-jacket-01",
        }
    ]


@pytest.mark.parametrize(
    ("images", "message"),
    [
        ("[]", "non-empty list"),
        ("[{id: a}]", "an image's tokens must be an integer"),
        ("[{tokens: 4}]", "an image needs an id"),
        ("[{id: a, tokens: 0}]", "an image's tokens must be an integer >= 1"),
        ("[{id: a, tokens: 4, size: 3}]", "size"),
    ],
)
def test_bad_images_are_refused_naming_the_line(tmp_path, images, message):
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nrequests:\n  - messages:\n      - {{role: user, content: hi, images: {images}}}\n")
    with pytest.raises(InputError, match=message) as err:
        load_scenario(path)
    assert "line 4" in str(err.value) or ":4" in str(err.value)
    r = CliRunner().invoke(app, ["simulate", str(path)])
    one_line_error(r, message)


def test_a_block_size_too_small_for_image_keys_is_refused(tmp_path):
    sc = load_scenario(SCENARIO)
    with pytest.raises(InputError, match="too small to key blocks by their media content"):
        from_scenario(sc, 2)


def test_replay_refuses_a_scenario_with_images_in_one_line():
    pytest.importorskip("torch")
    r = CliRunner().invoke(app, ["replay", str(SCENARIO)])
    one_line_error(r, "carries images", "simulate")
