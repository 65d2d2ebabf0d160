"""Every user error the CLI can meet ends in ONE `error:` line naming the file (and line), exit 2, no traceback.

Malformed traces, scenarios and run records; a device torch cannot use; Ctrl-C while something is still
loading (exit 130, "interrupted"); click's own usage errors; values a hostile user might try.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cli_testutil import one_line_error
from typer.testing import CliRunner

from prefixcache import cli
from prefixcache.cli import options, report
from prefixcache.core.errors import InputError, shown
from prefixcache.reports.record import build_record, load_record, save_record, to_json
from prefixcache.sim.policy import Capacity
from prefixcache.sim.replay import simulate as run_simulation
from prefixcache.sim.requests import from_scenario, from_trace
from prefixcache.workload import scenario as scenario_mod
from prefixcache.workload import trace as trace_mod
from prefixcache.workload.scenario import load_scenario
from prefixcache.workload.trace import load_trace

DATA = Path(__file__).parent / "data"
SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
SAMPLE = DATA / "mooncake_synthetic_3601_3800.jsonl"
HEAD = SAMPLE.read_text().splitlines()[:5]


def _short(value: object) -> str | None:
    """A readable test id for a long string parameter (pytest's default for the others)."""
    return " ".join(value.split())[:40] if isinstance(value, str) else None


def invoke(*args: object):
    return CliRunner().invoke(cli.app, [str(a) for a in args])


def trace_with(tmp_path: Path, line: str, name: str = "t.jsonl") -> Path:
    """Five good Mooncake lines, then ``line`` (line 6)."""
    p = tmp_path / name
    p.write_text("\n".join([*HEAD, line]) + "\n")
    return p


def line6(hash_ids: str, **extra: object) -> str:
    fields = {"timestamp": 1, "input_length": 1024, **extra}
    body = ", ".join(f'"{k}": {v}' for k, v in fields.items())
    return f'{{{body}, "hash_ids": {hash_ids}}}'


# ---- traces -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "line, message",
    [
        (line6("[1, [2, 3]]"), "hash_ids must hold 64-bit integers, found [2, 3]"),  # ragged: numpy raised
        (line6("[[1, 2], [3, 4]]"), "hash_ids must hold 64-bit integers, found [1, 2]"),
        (line6("[1, 2.5]"), "found 2.5"),
        (line6("[1, 2.0]"), "found 2.0"),
        (line6(f"[1, {2**63}]"), f"found {2**63}"),
        (line6(f"[1, {2**64}]"), f"found {2**64}"),
        (line6('[1, "2"]'), "found '2'"),
        (line6("[1, true]"), "found True"),  # numpy read it as 1
        (line6("[1, null]"), "found None"),
        (line6('[1, {"a": 2}]'), "found {'a': 2}"),
        (line6("[1, 2]", output_length=10**30), "output_length must be an integer >= 0"),  # OverflowError
        (line6("[1, 2]", timestamp=10**400), "timestamp must be a finite number"),  # OverflowError
        (line6("[1, 2]", timestamp="NaN"), "timestamp must be a finite number, got nan"),
        (line6("[1, 2]", block_size=10**30), "block_size must be a positive integer"),
        (line6("[1, 2]", input_length=10**30), "input_length must be an integer >= 1"),
        (line6("[1, " + "9" * 5000 + "]"), "not valid JSON"),  # ValueError: int digits limit
        ('{"hash_ids": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),  # RecursionError
        (line6("[1, 2]", session="[" * 1000 + "]" * 1000), "nested too deeply"),  # parses, too deep to show
        ("[" * 100_000, "nested too deeply"),
        ('"just a string"', "expected a JSON object, got str"),
    ],
    ids=_short,
)
def test_bad_trace_line_is_one_line_naming_file_and_line(tmp_path, line, message):
    p = trace_with(tmp_path, line)
    one_line_error(invoke("simulate", p, "--no-progress"), f"{p}:6: ", message)
    with pytest.raises(InputError, match=":6: "):
        load_trace(p)


def _gz(tmp_path: Path, data: bytes, name: str = "t.jsonl.gz") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _bad_trace_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    packed = gzip.compress(SAMPLE.read_bytes())
    (tmp_path / "dir.jsonl").mkdir()
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    return {
        "truncated gzip": (_gz(tmp_path, packed[: len(packed) // 2]), "cannot read trace"),
        "corrupt gzip": (_gz(tmp_path, packed[:20] + os.urandom(3000)), "cannot read trace"),  # zlib.error
        "not gzip": (_gz(tmp_path, b"plain text\n"), "cannot read trace"),
        "empty": (trace_with(tmp_path, "", "e.jsonl").with_name("e.jsonl"), ""),
        "binary": (_gz(tmp_path, b"\xff\xfe\x00" * 1000, "b.jsonl"), "not UTF-8"),
        "folder": (tmp_path / "dir.jsonl", "is a folder, not a trace file"),
        "device": (tmp_path / "zero.jsonl", "not a regular file or a pipe"),
        "missing": (tmp_path / "nope.jsonl", "no such trace file"),
    }


@pytest.mark.parametrize(
    "case", ["truncated gzip", "corrupt gzip", "not gzip", "binary", "folder", "device", "missing"]
)
def test_bad_trace_file_is_one_line(tmp_path, case):
    path, message = _bad_trace_files(tmp_path)[case]
    for command in ("simulate", "plan"):
        one_line_error(invoke(command, path), str(path), message)
    with pytest.raises(InputError, match=message):
        load_trace(path)


def test_empty_trace(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text("\n\n")
    one_line_error(invoke("simulate", p), f"{p}: trace holds no requests")


def test_endless_line_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_mod, "MAX_LINE_CHARS", 1000)
    p = trace_with(tmp_path, line6("[" + ", ".join(["1"] * 600) + "]"))
    one_line_error(invoke("simulate", p), f"{p}:6: line longer than")


def test_trace_from_a_pipe(tmp_path):
    """A FIFO (process substitution, /dev/stdin in a pipeline) is a valid input."""
    fifo = tmp_path / "t.jsonl"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(SAMPLE.read_bytes()), daemon=True)
    writer.start()
    r = invoke("simulate", fifo, "--json", "-", "--no-progress")
    writer.join(10)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["totals"][0]["requests"] == 200


# ---- scenarios --------------------------------------------------------------------------------------------
# a billion-leaf YAML alias bomb: anchors in generate entries (read after the requests), used by a conversation
BOMB = (
    "generate:\n"
    + "".join(
        f"  - shape: chat\n    users: &x{i} [{', '.join([f'*x{i - 1}'] * 10) if i else ', '.join(['1'] * 10)}]\n"
        for i in range(9)
    )
    + "requests:\n  - messages: [{role: user, content: a}]\n    conversation: *x8\n"
)


@pytest.mark.parametrize(
    "text, line, message",
    [
        (
            "requests:\n  - tokens: [1, 2, 2147483648]\n",
            2,
            "request 1 tokens[2] is 2147483648; token ids must be < 2**31",
        ),
        ("requests: " + "[" * 50_000 + "]" * 50_000 + "\n", None, "malformed YAML: nested too deeply"),
        ("requests: " + "[" * 200 + "]" * 200 + "\n", 1, "nested too deeply (over 100 levels"),  # quadratic scan
        ("seed: " + "7" * 5000 + "\nrequests: [{text: a}]\n", None, "malformed YAML"),
        ("requests:\n  - text: a\n    repeat: 100000000000000000000\n", 3, "repeat must be at most 10,000,000"),
        ("requests:\n  - text: a\n    max_new_tokens: 1000000000000\n", 3, "max_new_tokens must be at most"),
        ("requests:\n  - text: a\n    timestamp: " + "9" * 400 + "\n", 3, "timestamp must be a finite number"),
        ("requests:\n  - text: a\n    timestamp: .nan\n", 3, "timestamp must be a finite number, got nan"),
        ("generate:\n  shape: chat\n  5: 1\n", 2, "unknown key '5' for shape 'chat'"),  # TypeError in **params
        ("generate:\n  shape: chat\n  seed: [1]\n", 3, "seed must be an integer >= 0, got [1]"),  # TypeError: int([1])
        ("generate:\n  shape: chat\n  users: 1000000000000\n", 3, "users must be an integer in [1, 10,000,000]"),
        ("generate:\n  shape: rag\n  zipf: .nan\n", 3, "zipf must be a positive number"),
        ("generate:\n  shape: [chat]\n", 2, "must be a mapping with a 'shape'"),
        ("name: [1, 2]\nrequests: [{text: a}]\n", 1, "name must be a string"),
        (BOMB, 22, "conversation must be a string"),  # str() of a 10**9-leaf alias bomb hung
        ("capacity: [[1, 2]]\nrequests: [{text: a}]\n", 1, "expected a number of tokens"),
        ("", 1, "the scenario must be a mapping, got NoneType"),
        ("requests: [{text: a}]\nwhen: 2020-13-45\n", None, "malformed YAML"),  # ValueError from a date
    ],
    ids=_short,
)
def test_bad_scenario_is_one_line_naming_file_and_line(tmp_path, text, line, message):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    where = f"{p}:{line}: " if line is not None else f"{p}"
    one_line_error(invoke("simulate", p, "--no-progress"), where, message)
    with pytest.raises(InputError, match="s.yaml"):
        from_scenario(load_scenario(p), 16)


def test_scenario_request_count_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(scenario_mod, "MAX_REQUESTS", 5)
    p = tmp_path / "s.yaml"
    p.write_text("requests:\n  - text: a\n    repeat: 3\n  - text: b\n    repeat: 3\n")
    one_line_error(invoke("simulate", p), f"{p}:4: the scenario expands to more than 5 requests")


def test_scenario_files_that_are_not_scenarios(tmp_path, monkeypatch):
    (tmp_path / "adir.yaml").mkdir()
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    (tmp_path / "bin.yaml").write_bytes(b"name: x\n\xff\xfe\n")
    for path, message in [
        (tmp_path / "adir.yaml", "is a folder, not a scenario file"),
        (tmp_path / "zero.yaml", "not a regular file or a pipe"),  # /dev/zero would be read forever
        (tmp_path / "bin.yaml", ":2: not UTF-8 text (byte 0xff at column 1)"),
        (SCENARIOS, "is a folder"),
    ]:
        one_line_error(invoke("simulate", path), str(path), message)
    monkeypatch.setattr(scenario_mod, "MAX_SCENARIO_BYTES", 100)
    big = tmp_path / "big.yaml"
    big.write_text("requests:\n" + "  - text: a\n" * 50)
    one_line_error(invoke("simulate", big), f"{big}: larger than")


def test_token_id_out_of_range_in_simulate_and_api(tmp_path):
    """simulate used to crash on an id >= 2**31 (replay already said it cleanly); pinned through a subprocess."""
    p = tmp_path / "s.yaml"
    p.write_text("requests:\n  - text: fine\n  - tokens: [5, 2147483648]\n")
    r = subprocess.run(
        [sys.executable, "-m", "prefixcache", "simulate", str(p)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: {p}:3: request 2 tokens[1] is 2147483648; token ids must be < 2**31"
    ]


def test_subprocess_ragged_trace_is_one_line(tmp_path):
    p = trace_with(tmp_path, line6("[1, [2, 3]]"))
    r = subprocess.run(
        [sys.executable, "-m", "prefixcache", "plan", str(p)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"error: {p}:6: hash_ids must hold 64-bit integers, found [2, 3]"]


# ---- run records ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_record() -> dict:
    results = run_simulation(from_trace(load_trace(SAMPLE)), [Capacity(50), Capacity(None)])
    rec = to_json(build_record("simulate", str(SAMPLE), {"warmup": 0.0}, results))
    return json.loads(json.dumps(rec))


def _set(path: str, value: object):
    """An edit of a decoded record: ``path`` like "runs.0.rows.cached_tokens.3"; value DROP removes it."""

    def edit(d):
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        for p in parents:
            d = d[p]
        if value is DROP:
            del d[last]
        else:
            d[last] = value

    return edit


DROP = object()


@pytest.mark.parametrize(
    "edit, message",
    [
        (_set("totals", [{}]), "totals: has 1 entries, the runs 2"),
        (_set("totals.0", {}), "totals[0]: missing field 'requests'"),
        (_set("totals.1.requests", 5), "totals[1].requests: is 5 but runs[1].rows give 200"),
        (_set("totals", "abc"), "record.totals: expected a list, got str"),
        (_set("runs", "x"), "record.runs: expected a list, got str"),
        (_set("runs.1", []), "runs[1]: expected an object, got list"),
        (_set("runs.0.rows.cached_tokens", DROP), "runs[0].rows.cached_tokens: missing or not a list"),
        (_set("runs.0.rows.namespace.3", DROP), "runs[0].rows.namespace: has 199 values, the other columns 200"),
        (
            _set("runs.0.rows.prompt_tokens.7", "many"),
            "runs[0].rows.prompt_tokens[7]: expected an integer >= 0, got 'many'",
        ),
        (_set("runs.0.rows.prompt_tokens.7", -1), "runs[0].rows.prompt_tokens[7]: expected an integer >= 0, got -1"),
        (_set("runs.0.rows.cached_tokens.2", 10**400), "runs[0].rows.cached_tokens[2]: expected an integer >= 0"),
        (
            _set("runs.0.rows.cached_tokens.2", 10**9),
            "runs[0].rows.cached_tokens[2]: 1000000000 is more than prompt_tokens",
        ),
        (_set("runs.0.rows.hit_blocks.2", 10**6), "runs[0].rows.hit_blocks[2]: 1000000 is more than blocks"),
        (
            _set("runs.0.rows.timestamp.0", float("nan")),
            "runs[0].rows.timestamp[0]: expected a finite number or null, got nan",
        ),
        (_set("runs.0.rows.ttft_cached_s.0", -1.0), "runs[0].rows.ttft_cached_s[0]: expected a finite number >= 0"),
        (_set("runs.0.rows.warmup.0", 0), "runs[0].rows.warmup[0]: expected true or false, got 0"),
        (_set("runs.0.pool_blocks", 0), "runs[0].pool_blocks: must be >= 1, got 0"),
        (_set("runs.0.block_size", "512"), "runs[0].block_size: expected an integer >= 0, got '512'"),
        (_set("runs.0.partial", "no"), "runs[0].partial: expected true or false, got 'no'"),
        (_set("partial", "no"), "record.partial: expected true or false, got 'no'"),
        (_set("version", True), "run record version True is not supported"),
        (_set("version", 9), "run record version 9 is not supported"),
        (_set("command", 3), "record.command: expected a string, got 3"),
        (_set("settings", []), "record.settings: expected an object, got list"),
        (_set("settings.warmup", "half"), "record.settings.warmup: expected a finite number >= 0, got 'half'"),
    ],
    ids=_short,
)
def test_bad_record_names_the_field(tmp_path, good_record, edit, message):
    rec = json.loads(json.dumps(good_record))
    edit(rec)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(rec))
    one_line_error(invoke("report", p), f"{p}: ", message)
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]").replace("*", r"\*")):
        load_record(p)


def test_good_record_still_loads(tmp_path, good_record):
    p = tmp_path / "ok.json"
    p.write_text(json.dumps(good_record))
    assert invoke("report", p).exit_code == 0
    assert [r.capacity for r in load_record(p).runs] == [Capacity(50), Capacity(None)]


@pytest.mark.parametrize(
    "text, message",
    [
        ("[" * 100_000, "nested too deeply"),
        ('{"version": [' * 50_000 + "]}" * 50_000, "nested too deeply"),
        ('{"version": ' + "1" * 5000 + "}", "not valid JSON"),
        ("", "not valid JSON"),
        ("[1]", "not a prefixcache run record"),
    ],
    ids=_short,
)
def test_record_that_is_not_json_or_not_a_record(tmp_path, text, message):
    p = tmp_path / "r.json"
    p.write_text(text)
    one_line_error(invoke("report", p), str(p), message)


def test_record_inputs_that_are_not_files(tmp_path):
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    one_line_error(invoke("report", tmp_path), "is a folder, not a run record")
    one_line_error(invoke("report", tmp_path / "zero.json"), "not a regular file or a pipe")
    one_line_error(invoke("report", tmp_path / "none.json"), "no such run record")


# ---- replay --device ----------------------------------------------------------------------------------------
def _torch_has_cuda() -> bool:
    torch = pytest.importorskip("torch")
    return bool(torch.cuda.is_available())


@pytest.mark.parametrize(
    "device, message",
    [
        ("cuda", "--device: device 'cuda' is not usable here"),
        ("bogus", "--device: unknown device 'bogus'"),
        ("meta", "--device: device 'meta' is not usable here"),
        ("cuda:x", "--device: unknown device 'cuda:x'"),
    ],
)
def test_replay_device_checked_before_anything_loads(monkeypatch, device, message):
    if device == "cuda" and _torch_has_cuda():
        pytest.skip("this machine has CUDA")
    calls = []
    monkeypatch.setattr(options, "load_workload", lambda *a, **k: calls.append(a))
    one_line_error(invoke("replay", SCENARIOS / "chat.yaml", "--device", device), message)
    assert calls == []  # refused before the scenario was read


# ---- Ctrl-C while loading ---------------------------------------------------------------------------------
def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    "target, args",
    [
        ((options, "load_trace"), ["simulate", SAMPLE]),
        ((options, "load_trace"), ["plan", SAMPLE]),
        ((options, "load_scenario"), ["simulate", SCENARIOS / "chat.yaml"]),
        ((options, "load_scenario"), ["replay", SCENARIOS / "chat.yaml"]),
        ((report, "_load_any"), ["report", SAMPLE]),
        ((options, "load_trace"), ["explain", SAMPLE]),
    ],
)
def test_ctrl_c_while_loading_exits_130_interrupted(monkeypatch, target, args):
    monkeypatch.setattr(*target, _interrupt)
    r = invoke(*args)
    assert r.exit_code == 130 and "Traceback" not in r.output
    assert r.stderr.strip() == "interrupted"


def test_ctrl_c_while_the_model_loads(monkeypatch, tmp_path):
    engine_replay = pytest.importorskip("engine.replay")
    monkeypatch.setattr(engine_replay, "load_model", _interrupt)
    out = tmp_path / "run.json"
    r = invoke("replay", SCENARIOS / "chat.yaml", "--json", out, "--no-progress")
    assert r.exit_code == 130 and "Traceback" not in r.output
    assert "interrupted" in r.stderr
    rec = load_record(out)
    assert rec.partial and rec.runs == ()


# ---- options click itself parses, and other hostile values ------------------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        (["plan", SAMPLE, "--points", "1"], "Invalid value for '--points'"),
        (["plan", SAMPLE, "--points", "100000"], "Invalid value for '--points'"),
        (["simulate", SAMPLE, "--capacity-blocks", "abc"], "Invalid value for '--capacity-blocks'"),
        (["simulate", SAMPLE, "--bogus"], "No such option: --bogus"),
        (["simulate"], "Missing argument"),
        (["nope"], "No such command 'nope'"),
        (["simulate", SAMPLE, "--warmup", "1"], "--warmup"),
        (["simulate", SAMPLE, "--keep-for", "nan", "--eviction", "priority"], "--keep-for"),
        (["simulate", SAMPLE, "--keep-for", "inf", "--eviction", "priority"], "--keep-for"),
        (["plan", SAMPLE, "--dtype", "bf16"], "dtype 'bf16' needs a model"),
        (
            ["simulate", SCENARIOS / "chat.yaml", "--block-size", str(2**63)],
            "--block-size 9,223,372,036,854,775,808 is too large",
        ),
        (["simulate", "[/bold]odd.yaml"], "[/bold]odd.yaml: no such scenario file"),  # rich markup in a name
    ],
)
def test_option_errors_are_one_line(args, message):
    one_line_error(invoke(*args), message)


def test_huge_capacity_is_served_or_refused(tmp_path):
    out = tmp_path / "r.json"
    r = invoke("simulate", SAMPLE, "--capacity-blocks", str(10**18), "--json", out, "--no-progress")
    assert r.exit_code == 0, r.output
    rec = load_record(out)  # the record reads back
    assert rec.runs[0].capacity == Capacity(10**18) and rec.runs[0].totals()["evicted_blocks"] == 0
    for option, value in [("--capacity-blocks", str(2**63)), ("--capacity", "1e30")]:
        one_line_error(invoke("simulate", SAMPLE, option, value), "is too large")


def test_model_config_with_bad_numbers(tmp_path):
    for cfg, message in [
        ({"num_hidden_layers": [2], "num_attention_heads": 4, "hidden_size": 64}, "num_hidden_layers must be"),
        ({"num_hidden_layers": 2, "num_attention_heads": 0, "hidden_size": 64}, "num_attention_heads must be"),
        ({"num_hidden_layers": 2, "num_attention_heads": "4", "hidden_size": 64}, "num_attention_heads must be"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        one_line_error(invoke("plan", SAMPLE, "--model", tmp_path / "config.json"), message)


def test_shown_is_bounded_for_alias_bombs():
    x: list = [1] * 10
    for _ in range(12):
        x = [x] * 10  # 10**13 leaves
    assert len(shown(x)) <= 120 and shown([1, [2, 3]]) == "[1, [2, 3]]" and shown("a") == "'a'"


def test_report_round_trip_keeps_working(tmp_path):
    """Pins that a record written by this version passes every new check (and the CLI renders it)."""
    results = run_simulation(from_trace(load_trace(SAMPLE)), [Capacity(8), Capacity(100), Capacity(None)])
    p = tmp_path / "r.json"
    save_record(build_record("simulate", str(SAMPLE), {"warmup": 0.25}, results), p)
    assert load_record(p).totals() == [r.totals() for r in results]
