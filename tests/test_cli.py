"""The `prefixcache` CLI on real sample files: runs, sweeps, run records, user errors (exit 2), Ctrl-C."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prefixcache import cli
from prefixcache.sim.policy import Capacity
from prefixcache.sim.replay import Replayer, replay
from prefixcache.sim.requests import from_trace
from prefixcache.workload.trace import load_trace

DATA = Path(__file__).parent / "data"
SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
SAMPLE = DATA / "mooncake_synthetic_3601_3800.jsonl"
runner = CliRunner()


def run(*args: str):
    result = runner.invoke(cli.app, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result


def test_help_lists_commands():
    r = run("--help")
    assert r.exit_code == 0
    for cmd in ("simulate", "replay", "report"):
        assert cmd in r.output


def test_command_signatures_are_not_strings():
    """typer evaluates each command's annotations on every run: string annotations (PEP 563) cost ~10 ms."""
    modules = {c.callback.__module__ for c in cli.app.registered_commands if c.callback is not None}
    assert {"prefixcache.cli.simulate", "prefixcache.cli.serve"} <= modules
    for name in modules:
        source = Path(sys.modules[name].__file__).read_text(encoding="utf-8")
        assert "from __future__ import annotations" not in source, name


def test_simulate_sweep_writes_versioned_record(tmp_path):
    out = tmp_path / "run.json"
    r = run(
        "simulate", SAMPLE, "--capacity", "51200", "--capacity-blocks", "40", "--capacity", "unlimited", "--json", out
    )
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text())
    assert rec["version"] == 4 and rec["command"] == "simulate" and rec["partial"] is False
    caps = [t["capacity_blocks"] for t in rec["totals"]]
    assert caps == [40, 100, None]  # smallest first, unlimited last
    trace = load_trace(SAMPLE)
    for t, run_ in zip(rec["totals"], rec["runs"]):
        ref = replay(from_trace(trace), Capacity(t["capacity_blocks"])).totals()
        for key in ("requests", "prompt_tokens", "cached_tokens", "token_hit_rate", "block_hit_rate"):
            assert t[key] == ref[key]
        assert len(run_["rows"]["index"]) == 200  # rows are stored column by column
        assert {"prompt_tokens", "cached_tokens", "evicted_blocks", "outputs_match"} <= set(run_["rows"])
    assert rec["totals"][-1]["evicted_blocks"] == 0


def test_simulate_scenario_and_warmup(tmp_path):
    out = tmp_path / "run.json"
    r = run("simulate", SCENARIOS / "chat.yaml", "--warmup", "0.5", "--json", out)
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text())
    warmup = rec["runs"][0]["rows"]["warmup"]
    assert sum(warmup) == len(warmup) // 2
    assert rec["totals"][0]["requests"] == len(warmup) - len(warmup) // 2
    assert len(rec["totals"]) == 2  # the scenario's own capacities


def _bad_trace(tmp_path: Path, line: str) -> Path:
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join([*SAMPLE.read_text().splitlines()[:5], line]) + "\n")
    return p


@pytest.mark.parametrize(
    "make, args, message",
    [
        (
            lambda d: _bad_trace(d, '{"timestamp": 1, "input_length": 2000, "hash_ids": [1, 2]}'),
            [],
            ":6: 2 hash_ids for input_length 2000",
        ),
        (lambda d: _bad_trace(d, '{"timestamp": 1, "input_length": 20'), [], ":6: not valid JSON"),
        (
            lambda d: _bad_trace(d, '{"timestamp": 1, "input_length": 20, "hash_ids": [1], "x": 1}'),
            [],
            ":6: unknown key 'x'",
        ),
        (lambda d: d / "missing.jsonl", [], "no such trace file"),
        (lambda d: d / "missing.yaml", [], "no such scenario file"),
        (lambda d: SAMPLE, ["--capacity", "0"], "--capacity must be > 0"),
        (lambda d: SAMPLE, ["--capacity", "-3"], "--capacity must be > 0"),
        (lambda d: SAMPLE, ["--capacity", "lots"], "expected a number of tokens"),
        (lambda d: SAMPLE, ["--capacity", "1e400"], "expected a whole number of tokens"),
        (lambda d: SAMPLE, ["--capacity", "1.7"], "expected a whole number of tokens"),
        (lambda d: SAMPLE, ["--capacity", "0.5"], "expected a whole number of tokens"),
        (lambda d: SAMPLE, ["--capacity", "100"], "less than one block of 512"),
        (lambda d: SAMPLE, ["--capacity-blocks", "0"], "--capacity-blocks must be > 0"),
        (lambda d: SAMPLE, ["--warmup", "1.5"], "--warmup"),
        (lambda d: SAMPLE, ["--eviction", "random"], "unknown policy 'random'"),
    ],
)
def test_simulate_user_errors_exit_2(tmp_path, make, args, message):
    r = run("simulate", make(tmp_path), *args)
    assert r.exit_code == 2, r.output
    assert message in r.output


def test_bad_yaml_names_line_and_key(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("name: x\nrequests:\n  - text: hi\n    colour: red\n")
    r = run("simulate", p)
    assert r.exit_code == 2 and f"{p}:4: unknown key 'colour'" in r.output.replace("\n", "")
    p.write_text("requests:\n  - text: hi\n  x: [\n")
    r = run("simulate", p)
    assert r.exit_code == 2 and "malformed YAML" in r.output


def test_replay_refuses_a_trace():
    r = run("replay", SAMPLE)
    assert r.exit_code == 2 and "a model cannot replay them" in r.output


def test_ctrl_c_writes_partial_record(tmp_path, monkeypatch):
    out = tmp_path / "run.json"
    real_serve = Replayer.serve

    def serve(self, i, warmup=False):
        if i == 30:  # Ctrl-C while request 30 is served: 30 rows are done
            raise KeyboardInterrupt
        return real_serve(self, i, warmup)

    monkeypatch.setattr(Replayer, "serve", serve)
    r = run("simulate", SAMPLE, "--capacity-blocks", "100", "--capacity-blocks", "200", "--json", out)
    assert r.exit_code == 130
    rec = json.loads(out.read_text())
    assert rec["partial"] is True and len(rec["runs"]) == 1 and len(rec["runs"][0]["rows"]["index"]) == 30
    assert rec["totals"][0]["requests"] == 30
    r = run("report", out)  # the partial record still renders
    assert r.exit_code == 0 and "PARTIAL" in r.output


def test_report_renders_and_rejects_bad_records(tmp_path):
    out = tmp_path / "run.json"
    assert run("simulate", SAMPLE, "--capacity-blocks", "50", "--capacity-blocks", "500", "--json", out).exit_code == 0
    r = run("report", out, "--html", tmp_path / "r.html", "--markdown", tmp_path / "md" / "r.md")
    assert r.exit_code == 0, r.output
    assert "token hit rate" in r.output
    html = (tmp_path / "r.html").read_text()
    assert html.count("data:image/png;base64,") == 4 and "src='http" not in html
    md = (tmp_path / "md" / "r.md").read_text()
    for stem in ("causes", "hit_rate", "tokens_saved", "capacity"):
        assert (tmp_path / "md" / f"r_{stem}.png").read_bytes()[:4] == b"\x89PNG"
        assert f"(r_{stem}.png)" in md
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 9, "command": "simulate"}')
    r = run("report", bad)
    assert r.exit_code == 2 and "version 9 is not supported" in r.output
    bad.write_text('{"version": 1,\n "command": }')
    r = run("report", bad)
    assert r.exit_code == 2 and "bad.json:2: not valid JSON" in r.output.replace("\n", "")
    assert run("report", tmp_path / "nope.json").exit_code == 2


def test_console_script_entry_point(tmp_path):
    """The installed entry point runs in a fresh process; a user error exits 2 without a traceback."""
    r = subprocess.run(
        [sys.executable, "-c", "from prefixcache.cli import main; main()", "simulate", str(tmp_path / "missing.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "no such trace file" in r.stderr and "Traceback" not in r.stderr


def test_version_is_the_packages_and_pyprojects():
    import re

    from prefixcache._version import __version__

    r = run("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"prefixcache {__version__}"
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    declared = re.search(r'^version = "([^"]+)"', pyproject, re.M)
    assert declared is not None and declared.group(1) == __version__


def _commands():
    import typer.main

    group = typer.main.get_command(cli.app)
    return group, {name: group.commands[name] for name in group.commands if name != "eval"}  # eval: lm-eval's


def test_help_shows_no_type_for_flags_and_names_every_argument_alike():
    group, commands = _commands()
    for args in [["--help"], *([name, "--help"] for name in commands)]:
        r = run(*args)
        assert r.exit_code == 0, args
        assert "<bool>" not in r.output, args  # a flag takes no value
    for name, command in commands.items():
        for param in command.params:
            if param.param_type_name == "argument":  # one style: an upper-case placeholder, like SCENARIO
                assert param.metavar is not None and param.metavar.isupper(), (name, param.name)
                assert f"{{{param.metavar}}}" in run(name, "--help").output  # the usage line shows it


def test_top_level_examples_cover_every_main_command():
    out = run("--help").output
    for cmd in ("simulate", "explain", "plan", "replay", "report", "serve"):
        assert f"prefixcache {cmd} " in out, cmd


def test_simulate_shows_the_causes_its_help_promises(tmp_path):
    out = tmp_path / "run.json"
    r = run("simulate", SCENARIOS / "chat.yaml", "--json", out)
    assert r.exit_code == 0, r.output
    assert "Uncached tokens by cause" in r.stdout
    totals = json.loads(out.read_text())["totals"]
    for t in totals:
        assert f"{t['cold_tokens']:,}" in r.stdout and f"{t['partial_block_tokens']:,}" in r.stdout
    assert "uncached tokens by cause" in " ".join(run("simulate", "--help").output.split())


def test_the_main_jobs_outputs_land_in_an_ignored_folder():
    """The documented main job and the help's examples write into runs/, which git ignores."""
    root = Path(__file__).resolve().parents[1]
    assert "runs/" in (root / ".gitignore").read_text(encoding="utf-8").split()
    assert "--json runs/run.json" in run("--help").output
    if (root / ".git").exists():
        for name in ("runs/run.json", "runs/run.html"):
            assert subprocess.run(["git", "check-ignore", "-q", name], cwd=root).returncode == 0, name
