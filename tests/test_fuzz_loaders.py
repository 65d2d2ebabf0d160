"""Loader fuzzing: malformed traces, scenarios and run records, made by mutating valid samples, give either
a result or one clean error (InputError from the API; exit 2 with one `error:` line and no traceback from
the CLI), never another exception.

Mutations are structural (drop, add or retype a field anywhere in the tree, ragged or very deep nesting,
huge and non-finite numbers, a YAML alias bomb, duplicated lines) and textual (truncation, random bytes,
a truncated gzip stream), so most inputs get past the parser and reach the checks behind it.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from prefixcache import cli
from prefixcache.core.errors import InputError
from prefixcache.reports.record import build_record, load_record, to_json
from prefixcache.reports.run_report import summary
from prefixcache.sim.diagnosis import DivergenceSite
from prefixcache.sim.policy import Capacity
from prefixcache.sim.replay import simulate as run_simulation
from prefixcache.sim.requests import from_scenario, from_trace
from prefixcache.sim.results import Row, RunResult
from prefixcache.workload.scenario import load_scenario
from prefixcache.workload.trace import load_trace

DATA = Path(__file__).parent / "data"
MOONCAKE = (DATA / "mooncake_synthetic_3601_3800.jsonl").read_text().splitlines()[:4]
KVTESTER = (DATA / "kvtester_sample.jsonl").read_text().splitlines()
# PREFIXCACHE_FUZZ_EXAMPLES=2000 for a longer hunt; the default keeps the three tests to ~20 s here
FUZZ = settings(
    max_examples=int(os.environ.get("PREFIXCACHE_FUZZ_EXAMPLES", "120")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# ---- values and mutations ---------------------------------------------------------------------------------
# Numbers a loader must classify: small (cheap even when valid), at the int32/int64 edges, beyond them,
# not finite. No valid-but-huge counts, so that a mutated input that happens to be valid still runs fast.
INTS = [0, 1, 2, 3, 17, -1, -(2**63), 2**31, 2**63 - 1, 2**63, 2**64, 10**30]
FLOATS = [0.0, 0.5, -1.5, 2.0, 1e308, float("inf"), float("-inf"), float("nan")]
DEEP = "__deep__"  # replaced by nesting deeper than the recursion limit after dumping
BOMB = "__bomb__"  # replaced by a YAML alias bomb (a billion leaves) after dumping

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(INTS),
    st.sampled_from(FLOATS),
    st.text(max_size=8),
    st.sampled_from([DEEP, BOMB]),
)
values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)


def slots(tree: Any) -> list[tuple[Any, Any]]:
    """Every (container, key or index) in a JSON-like tree, the tree's own top level included."""
    out: list[tuple[Any, Any]] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            out.append((node, k))
            stack.append(v)
    return out


def mutate(data: st.DataObject, tree: Any) -> Any:
    """1-3 structural mutations of a deep copy of ``tree``."""
    tree = copy.deepcopy(tree)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        places = slots(tree)
        if not places:
            break
        parent, key = data.draw(st.sampled_from(places), label="where")
        op = data.draw(st.sampled_from(["set", "set", "drop", "add", "ragged", "wrap"]), label="op")
        if op == "set":
            parent[key] = data.draw(values, label="value")
        elif op == "drop":
            del parent[key]
        elif op == "add":
            if isinstance(parent, dict):
                parent[data.draw(st.text(max_size=6), label="key")] = data.draw(values, label="value")
            else:
                parent.append(data.draw(values, label="value"))
        elif op == "ragged":
            parent[key] = [parent[key], [parent[key]]]
        else:
            parent[key] = [parent[key]]
    return tree


def nest(text: str) -> str:
    """Replace the placeholders of ``values`` (as a JSON or YAML string) by what they stand for."""
    bomb = ", ".join(f"&b{i} [{', '.join([f'*b{i - 1}'] * 10) if i else ', '.join(['1'] * 10)}]" for i in range(9))
    for q in ('"', "'", ""):
        text = text.replace(f"{q}{DEEP}{q}", "[" * 5000 + "]" * 5000).replace(f"{q}{BOMB}{q}", f"[{bomb}]")
    return text


def damage(data: st.DataObject, raw: bytes) -> bytes:
    """Maybe one textual mutation: truncate, insert random bytes, or flip one byte."""
    op = data.draw(st.sampled_from(["none", "none", "none", "truncate", "insert", "flip"]), label="text op")
    if op == "none" or not raw:
        return raw
    at = data.draw(st.integers(0, len(raw) - 1), label="at")
    if op == "truncate":
        return raw[:at]
    if op == "insert":
        return raw[:at] + data.draw(st.binary(min_size=1, max_size=8), label="bytes") + raw[at:]
    return raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255), label="xor")]) + raw[at + 1 :]


# ---- the checks -------------------------------------------------------------------------------------------
def api_ok(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or None when it raised InputError; any other exception fails the test."""
    try:
        return fn(*args)
    except InputError as exc:
        assert "\n" not in str(exc), str(exc)
        return None


def cli_ok(*args: object) -> None:
    """The command succeeds, or fails with exit 2 and one `error:` line as its last line; no traceback."""
    r = CliRunner().invoke(cli.app, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output, r.output
    assert r.exit_code in (0, 2), (r.exit_code, r.output)
    if r.exit_code == 2:
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and r.stderr.strip().splitlines()[-1] == errors[0], r.stderr


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


# ---- traces -----------------------------------------------------------------------------------------------
@FUZZ
@given(data=st.data())
def test_fuzzed_traces(work, data):
    lines = [json.loads(x) for x in data.draw(st.sampled_from([MOONCAKE, KVTESTER]), label="sample")]
    lines = mutate(data, lines)
    text = "\n".join(nest(json.dumps(x)) for x in lines) + "\n"
    raw = damage(data, text.encode())
    if data.draw(st.booleans(), label="gzip"):
        packed = gzip.compress(raw)
        raw = packed[: data.draw(st.integers(1, len(packed)), label="gzip cut")]
        path = work / "t.jsonl.gz"
    else:
        path = work / "t.jsonl"
    path.write_bytes(raw)
    trace = api_ok(load_trace, path)
    if trace is not None:
        run_simulation(from_trace(trace), [Capacity(4)])
    cli_ok("simulate", path, "--no-progress", "--capacity-blocks", "4")
    cli_ok("plan", path, "--points", "4")
    cli_ok("explain", path, "--no-progress", "--capacity-blocks", "4")


# ---- scenarios --------------------------------------------------------------------------------------------
def _scenarios(trace_path: Path) -> list[dict[str, Any]]:
    return [
        {
            "name": "fuzz",
            "block_size": 4,
            "max_new_tokens": 3,
            "seed": 1,
            "capacity": [64, "1k", "unlimited"],
            "requests": [
                {"text": "hello world"},
                {"tokens": [1, 2, 3, 4, 5], "repeat": 2},
                {
                    "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
                    "conversation": "c",
                    "timestamp": 1.0,
                    "namespace": "n",
                    "max_new_tokens": 2,
                },
            ],
        },
        {
            "max_new_tokens": 2,
            "generate": [
                {"shape": "chat", "users": 2, "turns": 2, "system_prompt_tokens": 20, "user_tokens": 5},
                {"shape": "rag", "requests": 3, "documents": 4, "document_tokens": 10, "docs_per_request": 2},
                {"shape": "agent", "agents": 1, "steps": 2, "system_prompt_tokens": 8, "tool_output_tokens": 4},
            ],
        },
        {"name": "pointer", "trace": str(trace_path), "capacity": "4k"},
    ]


@FUZZ
@given(data=st.data())
def test_fuzzed_scenarios(work, data):
    trace_path = work / "pointed.jsonl"
    trace_path.write_text("\n".join(MOONCAKE) + "\n")
    doc = mutate(data, data.draw(st.sampled_from(_scenarios(trace_path)), label="sample"))
    text = nest(yaml.safe_dump(doc, sort_keys=False, width=10_000))
    lines = text.splitlines(keepends=True)
    if lines and data.draw(st.booleans(), label="duplicate a line"):  # duplicate keys, repeated items
        k = data.draw(st.integers(0, len(lines) - 1), label="line")
        lines.insert(k, lines[k])
    path = work / "s.yaml"
    path.write_bytes(damage(data, "".join(lines).encode()))
    scenario = api_ok(load_scenario, path)
    if scenario is not None:
        api_ok(from_scenario, scenario, 4)
    cli_ok("simulate", path, "--no-progress")
    cli_ok("explain", path, "--no-progress")
    if scenario is not None and scenario.trace is not None:
        cli_ok("plan", path, "--points", "4", "--no-bound")


# ---- run records ------------------------------------------------------------------------------------------
def _records() -> list[dict[str, Any]]:
    trace = load_trace(DATA / "mooncake_synthetic_3601_3800.jsonl")[:12]
    sim = run_simulation(from_trace(trace), [Capacity(8), Capacity(None)])
    timed = tuple(
        Row(i, "default", 40, 16 * (i % 3), 3, i % 3, 1, 0, 3, i == 0, 10.0 * i, 4, 0.01, 0.05, 0.03, 0.06, i != 2)
        for i in range(6)
    )
    replayed = [RunResult(Capacity(4), 4, 16, timed), RunResult(Capacity(None), 9, 16, timed, partial=True)]
    return [
        to_json(build_record("simulate", "t.jsonl", {"warmup": 0.0, "capacities": ["a", "b"]}, sim)),
        to_json(
            build_record(
                "replay",
                "s.yaml",
                {"model": "tiny", "warmup": 0.2},
                replayed,
                partial=True,
                divergences=[DivergenceSite(12, 2, 40, 3, 1, "shared [b]text", "this", "other")],
            )
        ),
    ]


@pytest.fixture(scope="module")
def records() -> list[dict[str, Any]]:
    return json.loads(json.dumps(_records()))


@FUZZ
@given(data=st.data())
def test_fuzzed_run_records(work, records, data):
    rec = mutate(data, data.draw(st.sampled_from(records), label="sample"))
    path = work / "r.json"
    path.write_bytes(damage(data, nest(json.dumps(rec)).encode()))
    record = api_ok(load_record, path)
    if record is not None:
        summary(record)
    cli_ok("report", path)
    cli_ok("explain", path)
