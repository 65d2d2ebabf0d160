"""Output options (--json, --html, --markdown) of every command never clobber what the user pointed at.

A regular file is written atomically (temp file + rename; nothing left behind when the save fails), a
symlink is followed to its target, a FIFO or a device is written in place, ``-`` is stdout (holding only
that output), and an unwritable place is refused in one line before any work starts.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cli_testutil import one_line_error
from typer.testing import CliRunner

from prefixcache import cli
from prefixcache.cli import options, plan, report, simulate
from prefixcache.reports import output
from prefixcache.reports.record import build_record, load_record, save_record
from prefixcache.sim.policy import Capacity
from prefixcache.sim.replay import simulate as run_simulation
from prefixcache.sim.requests import from_trace
from prefixcache.workload.trace import load_trace

DATA = Path(__file__).parent / "data"
SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
SAMPLE = DATA / "mooncake_synthetic_3601_3800.jsonl"
OPTIONS = ("--json", "--html", "--markdown")


@pytest.fixture(scope="module")
def record_file(tmp_path_factory) -> Path:
    """A saved simulate record (two capacities) for `report`."""
    results = run_simulation(from_trace(load_trace(SAMPLE)), [Capacity(50), Capacity(None)])
    path = tmp_path_factory.mktemp("rec") / "run.json"
    save_record(build_record("simulate", str(SAMPLE), {"source": str(SAMPLE)}, results), path)
    return path


def command_args(command: str, record: Path) -> list[str]:
    """A cheap invocation of ``command`` (before its output options)."""
    return {
        "simulate": ["simulate", str(SAMPLE), "--capacity-blocks", "50", "--no-progress"],
        "plan": ["plan", str(SAMPLE), "--points", "4", "--no-bound"],
        "report": ["report", str(record)],
        "explain": ["explain", str(record)],
        "replay": [
            "replay",
            str(SCENARIOS / "shared_prompt.yaml"),
            "--max-requests",
            "2",
            "--no-baseline",
            "--no-progress",
        ],
    }[command]


def invoke(*args: object):
    r = CliRunner().invoke(cli.app, [str(a) for a in args])
    assert "Traceback" not in r.output, r.output
    return r


def check_content(option: str, data: bytes) -> None:
    """The bytes are a complete output of ``option``: a run record or a plan for JSON."""
    if option == "--json":
        d = json.loads(data)
        if "version" in d:  # a run record (simulate, replay, report)
            assert d["version"] == 4 and d["runs"] and len(d["totals"]) == len(d["runs"])
        elif "command" in d:  # an explanation
            assert d["source"] == str(SAMPLE) and d["runs"] and "causes" in d["runs"][0]
        else:  # a plan
            assert d["trace"] == str(SAMPLE) and d["requests"] == 200
    elif option == "--html":
        text = data.decode()
        assert text.startswith("<!doctype html>") and text.rstrip().endswith("</html>")
    else:
        assert data.decode().startswith("# ")


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp") or p.name.startswith("."))


COMMANDS = ("simulate", "plan", "report")
# every (command, output option) pair that is cheap to run (explain writes JSON only)
PAIRS = [(c, o) for c in COMMANDS for o in OPTIONS] + [("explain", "--json")]
JSON_LIKE = [(c, o) for c, o in PAIRS if o != "--markdown"]


# ---- regular files ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command, option", PAIRS)
def test_regular_file_in_a_new_folder(tmp_path, record_file, command, option):
    out = tmp_path / "new" / "deeper" / ("out" + {"--json": ".json", "--html": ".html", "--markdown": ".md"}[option])
    r = invoke(*command_args(command, record_file), option, out)
    assert r.exit_code == 0, r.output
    check_content(option, out.read_bytes())
    assert leftovers(out.parent) == []
    if option == "--markdown":  # the plots beside it, linked by name
        pngs = sorted(p.name for p in out.parent.glob("*.png"))
        assert pngs and all(f"({name})" in out.read_text() for name in pngs)


def test_replay_writes_every_output(tmp_path):
    outs = {opt: tmp_path / "r" / f"run{ext}" for opt, ext in zip(OPTIONS, (".json", ".html", ".md"))}
    r = invoke(*command_args("replay", Path()), *[x for opt, p in outs.items() for x in (opt, p)])
    assert r.exit_code == 0, r.output
    for opt, p in outs.items():
        check_content(opt, p.read_bytes())
    assert load_record(outs["--json"]).command == "replay"
    assert leftovers(tmp_path / "r") == []


def test_existing_file_is_replaced_atomically_keeping_its_mode(tmp_path):
    out = tmp_path / "run.json"
    out.write_text("old")
    out.chmod(0o640)
    inode = out.stat().st_ino
    r = invoke(*command_args("simulate", Path()), "--json", out)
    assert r.exit_code == 0, r.output
    assert load_record(out).runs and stat.S_IMODE(out.stat().st_mode) == 0o640
    assert out.stat().st_ino != inode  # a new file renamed over the old one, not the old one rewritten
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
@pytest.mark.parametrize("option", OPTIONS)
def test_failed_save_leaves_no_temp_file_and_the_old_file_intact(tmp_path, monkeypatch, option, failure):
    out = tmp_path / ("run" + {"--json": ".json", "--html": ".html", "--markdown": ".md"}[option])
    out.write_text("old contents")

    def failing_replace(src, dst):
        assert Path(src).exists() and Path(src).parent == tmp_path  # the temp file sits beside the target
        raise failure

    monkeypatch.setattr(output.os, "replace", failing_replace)
    r = invoke(*command_args("simulate", Path()), option, out)
    if isinstance(failure, KeyboardInterrupt):
        assert r.exit_code == 130 and "interrupted" in r.stderr
    else:
        one_line_error(r, str(tmp_path / "run"), "cannot write: No space left on device")  # run.md or its first PNG
    assert out.read_text() == "old contents"
    assert leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no PNG of a Markdown either


# ---- symlinks, FIFOs, devices, stdout ---------------------------------------------------------------------
@pytest.mark.parametrize("command, option", JSON_LIKE)
def test_symlink_is_followed(tmp_path, record_file, command, option):
    (tmp_path / "elsewhere").mkdir()
    target = tmp_path / "elsewhere" / "real.out"
    target.write_text("old")
    link = tmp_path / "link.out"
    link.symlink_to(target)
    r = invoke(*command_args(command, record_file), option, link)
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and os.readlink(link) == str(target)
    check_content(option, target.read_bytes())
    assert leftovers(tmp_path) == [] and leftovers(tmp_path / "elsewhere") == []


def test_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "sub" / "real.json")
    r = invoke(*command_args("simulate", Path()), "--json", link)
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and load_record(tmp_path / "sub" / "real.json").runs


def test_markdown_through_a_symlink_puts_its_plots_beside_the_link(tmp_path, record_file):
    (tmp_path / "elsewhere").mkdir()
    target = tmp_path / "elsewhere" / "real.md"
    link = tmp_path / "report.md"
    link.symlink_to(target)
    r = invoke("report", record_file, "--markdown", link)
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and target.read_text().startswith("# ")
    pngs = sorted(p.name for p in tmp_path.glob("report_*.png"))
    assert pngs and all(f"({name})" in target.read_text() for name in pngs)


@pytest.mark.parametrize("command, option", JSON_LIKE)
def test_fifo_is_written_in_place(tmp_path, record_file, command, option):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    try:
        r = invoke(*command_args(command, record_file), option, fifo)
    finally:
        reader.join(2)
        if reader.is_alive():  # the command never opened the FIFO: unblock the reader
            # non-blocking, so a reader that is just finishing cannot leave this open waiting forever (ENXIO
            # then: nobody has it open for reading any more)
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(10)
    assert r.exit_code == 0, r.output
    assert stat.S_ISFIFO(fifo.stat().st_mode)  # still a FIFO, not replaced by a file
    check_content(option, got[0])
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("command, option", JSON_LIKE)
def test_dash_is_stdout_and_holds_only_the_output(record_file, command, option):
    r = invoke(*command_args(command, record_file), option, "-")
    assert r.exit_code == 0, r.output
    check_content(option, r.stdout.encode())
    shown = "prefixcache explain" if command == "explain" else "┘"
    assert shown in r.stderr and "written to standard output" in r.stderr  # the tables went to stderr


def test_replay_json_to_stdout():
    r = invoke(*command_args("replay", Path()), "--json", "-")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["command"] == "replay"


@pytest.mark.parametrize("command", COMMANDS)
def test_dev_null_stays_a_device(record_file, command):
    r = invoke(*command_args(command, record_file), "--json", os.devnull, "--html", os.devnull)
    assert r.exit_code == 0, r.output
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_device_is_one_line_and_stays_a_device():
    r = invoke(*command_args("simulate", Path()), "--json", "/dev/full")
    one_line_error(r, "/dev/full", "No space left on device")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


# ---- refused before any work ------------------------------------------------------------------------------
def _no_work(monkeypatch):
    """Make every command's computation fail loudly if it starts."""

    def boom(*a, **k):
        raise AssertionError("the computation started before the output was checked")

    monkeypatch.setattr(options, "load_workload", boom)
    monkeypatch.setattr(simulate, "run_simulation", boom)
    monkeypatch.setattr(plan, "make_plan", boom)
    monkeypatch.setattr(report, "_load_any", boom)


def _bad_places(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    return {
        "directory": (tmp_path / "adir", "it is a directory"),
        "under a file": (tmp_path / "afile" / "x.json", "is not a folder"),
        "deep under a file": (tmp_path / "afile" / "sub" / "x.json", "cannot create its folder"),
        "proc": (Path("/proc/x.json"), "cannot write in /proc"),
        "loop": (tmp_path / "loop", "cannot write"),
    }


@pytest.mark.parametrize("command, option", [*PAIRS, *(("replay", o) for o in OPTIONS)])
@pytest.mark.parametrize("place", ["directory", "under a file", "deep under a file", "proc", "loop"])
def test_unwritable_place_refused_before_any_work(tmp_path, record_file, monkeypatch, command, option, place):
    if place == "proc" and not Path("/proc/self").exists():
        pytest.skip("no /proc")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    path, message = _bad_places(tmp_path)[place]
    _no_work(monkeypatch)
    r = invoke(*command_args(command, record_file), option, path)
    one_line_error(r, str(path), message)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write in a read-only folder")
@pytest.mark.parametrize("command", COMMANDS)
def test_read_only_folder_refused_before_any_work(tmp_path, record_file, monkeypatch, command):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        _no_work(monkeypatch)
        r = invoke(*command_args(command, record_file), "--json", folder / "x.json")
        one_line_error(r, "Permission denied")
    finally:
        folder.chmod(0o700)


@pytest.mark.parametrize("command", [*COMMANDS, "replay"])
@pytest.mark.parametrize(
    "args, message",
    [
        (["--markdown", "-"], "cannot be written to standard output"),
        (["--markdown", os.devnull], "not a regular file"),
        (["--json", "-", "--html", "-"], "--json and --html both write to standard output"),
        (["--json", "SAME", "--html", "SAME"], "--json and --html both write to"),
        (["--json", "SAME", "--markdown", "LINK"], "--json and --markdown both write to"),
    ],
)
def test_conflicting_outputs_refused_before_any_work(tmp_path, record_file, monkeypatch, command, args, message):
    (tmp_path / "link.md").symlink_to(tmp_path / "same.md")
    args = [{"SAME": str(tmp_path / "same.md"), "LINK": str(tmp_path / "link.md")}.get(a, a) for a in args]
    _no_work(monkeypatch)
    one_line_error(invoke(*command_args(command, record_file), *args), message)


# ---- a real process ---------------------------------------------------------------------------------------
def _run(*args: object) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run(
        [sys.executable, "-m", "prefixcache", *map(str, args)], capture_output=True, timeout=120, env=env
    )


def test_subprocess_json_to_stdout_and_refusal():
    r = _run("simulate", SAMPLE, "--capacity-blocks", "50", "--json", "-")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["totals"][0]["capacity_blocks"] == 50
    r = _run("plan", SAMPLE, "--json", "/proc/x.json")
    assert r.returncode == 2 and b"Traceback" not in r.stderr
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: /proc/x.json: cannot write"), lines
