"""Trace and scenario loaders: formats, validation messages, generators, the byte renderer."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

from prefixcache.core.errors import InputError
from prefixcache.workload.generators import GENERATORS, generate
from prefixcache.workload.render import ByteRenderer, Conversations
from prefixcache.workload.requests import Message, ScenarioRequest
from prefixcache.workload.scenario import load_scenario
from prefixcache.workload.trace import load_trace

DATA = Path(__file__).parent / "data"
SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
SAMPLE = DATA / "mooncake_conversation_head200.jsonl"


def _raw_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_mooncake_sample_matches_raw_json():
    trace = load_trace(SAMPLE)
    raw = _raw_lines(SAMPLE)
    assert len(trace) == len(raw) == 200
    assert trace.block_size == 512
    for k in (0, 1, 57, 199):
        r = trace[k]
        assert r.hash_ids == tuple(raw[k]["hash_ids"])
        assert (r.input_length, r.output_length, r.timestamp) == (
            raw[k]["input_length"],
            raw[k]["output_length"],
            raw[k]["timestamp"],
        )
        assert r.namespace == "default" and r.line == k + 1
        assert len(r.hash_ids) == math.ceil(r.input_length / 512)
    assert trace.num_blocks == sum(len(d["hash_ids"]) for d in raw)
    assert trace.unique_blocks() == len({h for d in raw for h in d["hash_ids"]})
    assert [r.hash_ids for r in trace[10:13]] == [tuple(d["hash_ids"]) for d in raw[10:13]]


def test_gzip_equals_plain(tmp_path):
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(SAMPLE.read_bytes()))
    a, b = load_trace(SAMPLE), load_trace(gz)
    assert list(a) == list(b)


def test_kvtester_lines_floor_blocks_and_sessions():
    trace = load_trace(DATA / "kvtester_sample.jsonl")
    assert trace.block_size == 64
    assert trace[0].namespace == "session-0"
    assert len(trace[0].hash_ids) == trace[0].input_length // 64  # full blocks only
    with pytest.raises(InputError, match="block_size 64 but 512"):
        load_trace(DATA / "kvtester_sample.jsonl", 512)


def test_by_timestamp_is_stable(tmp_path):
    p = tmp_path / "t.jsonl"
    rows = [{"timestamp": t, "input_length": 10, "hash_ids": [i]} for i, t in enumerate([5, 1, 5, 0])]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    t = load_trace(p, block_size=16).by_timestamp()
    assert [r.hash_ids[0] for r in t] == [3, 1, 0, 2]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"timestamp": 0, "input_length": 1000, "hash_ids": [1, 2, 3]}', "3 hash_ids for input_length 1000"),
        ('{"timestamp": 0, "input_length": 100, "hash_ids": [1], "colour": 2}', "unknown key 'colour'"),
        ('{"timestamp": 0, "input_length": 100, "hash_ids": [1]', "not valid JSON"),
        ('{"timestamp": 0, "hash_ids": [1]}', "missing field 'input_length'"),
        ('{"timestamp": 0, "input_length": 100, "hash_ids": []}', "hash_ids must be a non-empty list"),
        ('{"timestamp": 0, "input_length": 100, "hash_ids": [1.5]}', "64-bit integers, found 1.5"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_trace_line_names_file_and_line(tmp_path, line, message):
    good = SAMPLE.read_text().splitlines()[:3]
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join([*good, line]) + "\n")
    with pytest.raises(InputError) as e:
        load_trace(p)
    assert f"{p}:4: " in str(e.value) and message in str(e.value)


def test_missing_trace():
    with pytest.raises(InputError, match="no such trace file"):
        load_trace(DATA / "nope.jsonl")


# ---- scenarios ----------------------------------------------------------------------------------------------
def test_handwritten_scenario_every_form():
    sc = load_scenario(SCENARIOS / "handwritten.yaml")
    kinds = [r.kind for r in sc.requests]
    assert kinds == ["text", "text", "chat", "chat", "chat", "tokens", "tokens", "tokens", "tokens"]
    assert sc.block_size == 4 and sc.max_new_tokens == 8 and sc.seed == 7 and sc.model == "tiny"
    assert sc.requests[1].max_new_tokens == 4
    assert sc.requests[3].conversation == "alice" and sc.requests[3].timestamp == 1500.0
    assert sc.requests[4].namespace == "tenant-b"
    assert sc.requests[5] == sc.requests[6] == sc.requests[7]  # repeat: 3
    conv = Conversations()
    conv.add_reply(sc.requests[2], "red, green, blue")
    msgs = conv.messages(sc.requests[3])
    assert [m.role for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[2].content == "red, green, blue"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "text, message, line",
    [
        ("requests:\n  - text: hi\n    colour: red\n", "unknown key 'colour' in request 1", 3),
        ("name: x\nbogus: 1\nrequests:\n  - text: hi\n", "unknown key 'bogus' in the scenario", 2),
        ("requests:\n  - text: hi\n   - text: [unclosed\n", "malformed YAML", 3),
        ("requests:\n  - text: hi\n    tokens: [1]\n", "exactly one of text / messages / tokens", 2),
        ("requests:\n  - messages:\n      - {role: user, body: hi}\n", "unknown key 'body' in a message", 3),
        ("generate:\n  shape: chat\n  users: 2\n  turnz: 3\n", "unknown key 'turnz' for shape 'chat'", 4),
        ("generate:\n  shape: nope\n", "unknown shape 'nope'", 2),
        ("capacity: -5\nrequests:\n  - text: hi\n", "capacity must be > 0", 1),
        ("requests:\n  - tokens: [1, -2]\n", "tokens must be a non-empty list of integers >= 0", 2),
        ("max_new_tokens: 0\nrequests:\n  - text: hi\n", "max_new_tokens must be an integer >= 1", 1),
        ("name: only\n", "needs requests, generate or trace", 1),
    ],
)
def test_bad_scenario_names_file_line_and_key(tmp_path, text, message, line):
    p = _write(tmp_path, text)
    with pytest.raises(InputError) as e:
        load_scenario(p)
    assert message in str(e.value)
    assert str(e.value).startswith(f"{p}:{line}: ")


def test_scenario_trace_relative_to_file(tmp_path):
    (tmp_path / "t.jsonl").write_text(SAMPLE.read_text())
    sc = load_scenario(_write(tmp_path, "trace: t.jsonl\ncapacity: [512k, unlimited]\n"))
    assert sc.is_trace and len(sc) == 200 and sc.capacity == (512_000, None)


# ---- generators --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", sorted(GENERATORS))
def test_generators_are_seeded(shape):
    a, b, c = generate(shape, seed=3), generate(shape, seed=3), generate(shape, seed=4)
    assert a == b and a != c and len(a) > 1


def test_chat_generator_shape():
    reqs = generate("chat", seed=0, users=3, turns=4, system_prompt_tokens=100, user_tokens=20)
    assert len(reqs) == 12
    assert [r.conversation for r in reqs[:3]] == ["user-0", "user-1", "user-2"]  # interleaved
    first = reqs[0].messages
    assert first[0].role == "system" and len(first[0].content) == 100 and len(first[1].content) == 20
    assert all(len(r.messages) == 1 for r in reqs[3:])  # later turns add one message; history is carried


def test_rag_zipf_popularity():
    reqs = generate("rag", seed=1, requests=400, documents=20, docs_per_request=1, zipf=1.5, document_tokens=30)
    firsts = [r.messages[1].content.split("]")[0] for r in reqs]
    counts = {d: firsts.count(d) for d in set(firsts)}
    assert counts["[doc 0"] > counts.get("[doc 5", 0) > 0  # skewed: 1/1**1.5 vs 1/6**1.5


# ---- the byte renderer matches the built-in tokenizer ------------------------------------------------------
def test_byte_renderer_matches_builtin_tokenizer():
    pytest.importorskip("transformers")
    from engine.models import byte_tokenizer
    from engine.replay import HFRenderer

    tok = HFRenderer(byte_tokenizer())
    mine = ByteRenderer()
    msgs = [
        Message("system", "Be brief."),
        Message("user", "héllo wörld"),
        Message("assistant", "ok"),
        Message("user", "again"),
    ]
    assert mine.encode_chat(msgs) == tok.encode_chat(msgs)
    assert mine.encode_text("naïve text\nline 2") == tok.encode_text("naïve text\nline 2")
    conv = Conversations()
    req = ScenarioRequest(tokens=(5, 6, 7))
    assert conv.prompt(req, mine) == [5, 6, 7]
