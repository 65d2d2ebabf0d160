"""`prefixcache explain` and the "Why prefill was not saved" report section, on the ready scenarios that each
show one cause: the cause and position it names are checked against references computed from the scenario
text (the rendered prompts compared directly), and its advice against replays at the settings it suggests."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prefixcache import cli
from prefixcache.reports.record import build_record, load_record, save_record, to_json
from prefixcache.sim.diagnosis import partial_at
from prefixcache.sim.policy import Capacity
from prefixcache.sim.replay import replay, simulate
from prefixcache.sim.requests import from_scenario
from prefixcache.workload.render import ByteRenderer, Conversations
from prefixcache.workload.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
runner = CliRunner()


def explain(*args, tmp_path: Path) -> dict:
    out = tmp_path / "explain.json"
    r = runner.invoke(cli.app, ["explain", *map(str, args), "--no-progress", "--json", str(out)])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())


def lcp(a, b) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def prompts(name: str) -> list[list[int]]:
    """The scenario's prompts as the simulator renders them (byte tokenizer, chat template)."""
    sc = load_scenario(SCENARIOS / name)
    conv, renderer = Conversations(), ByteRenderer()
    return [conv.prompt(r, renderer) for r in sc.requests]


def test_dated_system_prompt_names_the_timestamp(tmp_path):
    out = explain(SCENARIOS / "dated_system_prompt.yaml", tmp_path=tmp_path)
    (run,) = out["runs"]
    assert run["main_cause"] == "diverged"
    p = prompts("dated_system_prompt.yaml")
    # where each request leaves the earlier ones: inside the seconds of "Current time: 2026-11-29 14:03:SS"
    firsts = [max(lcp(p[k], p[j]) for j in range(k)) for k in range(1, len(p))]
    seconds = 2 + len("Current time: 2026-11-29 14:03:")  # <|bos|><|system|> then the text
    assert set(firsts) == {seconds, seconds + 1}
    top = out["divergences"][0]
    assert (top["position"], top["requests"]) == (seconds, len(p) - 1)
    assert top["tokens"] == run["causes"]["diverged"] and len(out["divergences"]) == 1
    assert top["before"].endswith("14:03:") and top["this"][:1] != top["other"][:1]
    # the policy (everything but the time and the question) was lost to the divergence, for every request
    assert run["causes"]["diverged"] >= (len(p) - 1) * len("You are the support assistant of Acme Cloud.")


def test_reasoning_dropped_names_the_assistant_turn(tmp_path):
    out = explain(SCENARIOS / "reasoning_history.yaml", tmp_path=tmp_path)
    assert out["runs"][0]["main_cause"] == "diverged"
    sc = load_scenario(SCENARIOS / "reasoning_history.yaml")
    renderer = ByteRenderer()
    # each user's 3rd call departs where the 2nd call's assistant message (with its reasoning) starts
    want = sorted(len(renderer.encode_chat(sc.requests[k].messages[:2])) for k in (0, 3, 6))
    got = sorted(d["position"] for d in out["divergences"])
    assert got == want
    assert all(d["other"].startswith("<think>") and d["requests"] == 1 for d in out["divergences"])
    assert sorted(d["example"] for d in out["divergences"]) == [2, 5, 8]


def test_salted_tenants_name_the_namespace(tmp_path):
    out = explain(SCENARIOS / "salted_tenants.yaml", tmp_path=tmp_path)
    (run,) = out["runs"]
    assert run["main_cause"] == "namespace"
    p = prompts("salted_tenants.yaml")
    users = len(p) // 2
    shared = [max(lcp(p[k], p[j]) for j in range(k)) for k in range(1, users)]  # first round: other namespaces
    servable = [(len(p[k]) - 1) // 16 * 16 for k in range(1, users)]
    assert run["causes"]["namespace"] == sum(min(t // 16 * 16, s) for t, s in zip(shared, servable))


def test_small_pool_names_eviction_and_the_capacity_that_fixes_it(tmp_path):
    out = explain(SCENARIOS / "small_pool.yaml", tmp_path=tmp_path)
    small, unlimited = out["runs"]
    assert small["main_cause"] == "evicted" and unlimited["causes"]["evicted"] == 0
    x = small["reuse_capacity_blocks"]
    assert x > small["capacity_blocks"]
    assert any(f"{x:,} blocks" in f["advice"] for f in small["fixes"] if f["cause"] == "evicted")
    reqs = from_scenario(load_scenario(SCENARIOS / "small_pool.yaml"), 16)
    after = replay(reqs, Capacity(x)).totals()
    assert after["evicted_tokens"] <= 0.1 * small["causes"]["evicted"]
    assert replay(reqs, Capacity(x - 1)).totals()["evicted_tokens"] > after["evicted_tokens"]


def test_short_system_prompt_names_the_partial_block(tmp_path):
    out = explain(SCENARIOS / "short_system_prompt.yaml", tmp_path=tmp_path)
    (run,) = out["runs"]
    assert run["main_cause"] == "partial_block" and run["cached_tokens"] == 0
    shared = 2 + len("Be brief.") + 2  # <|bos|><|system|>Be brief.<|end|><|user|>
    fix = next(f for f in run["fixes"] if f["cause"] == "partial_block")
    assert f"most often {shared} tokens" in fix["advice"] and "lower the block size" in fix["advice"]
    rec = explain(SCENARIOS / "short_system_prompt.yaml", "--request", 3, tmp_path=tmp_path)["request"]
    assert rec["shared_tokens"] == shared and rec["runs"][0]["causes"]["partial_block"] > shared


@pytest.mark.parametrize("name", ["short_system_prompt.yaml", "chat.yaml", "rag.yaml", "dated_system_prompt.yaml"])
def test_partial_block_estimate_equals_a_replay_at_the_smaller_block_size(name):
    sc = load_scenario(SCENARIOS / name)
    rows16 = replay(from_scenario(sc, 16), Capacity(None)).rows
    for smaller in (8, 4, 1):
        got = replay(from_scenario(sc, smaller), Capacity(None)).totals()["partial_block_tokens"]
        assert partial_at(rows16, smaller) == got


def test_request_in_full(tmp_path):
    out = explain(SCENARIOS / "dated_system_prompt.yaml", "--request", 2, tmp_path=tmp_path)
    req = out["request"]
    assert req["request"] == 2 and req["divergence"]["position"] == req["shared_tokens"] == 33
    assert req["shared_with"] in (0, 1)
    causes = req["runs"][0]["causes"]
    assert sum(causes.values()) == req["prompt_tokens"] - req["runs"][0]["cached_tokens"]
    r = runner.invoke(cli.app, ["explain", str(SCENARIOS / "dated_system_prompt.yaml"), "--request", "2"])
    assert r.exit_code == 0 and "departs from request" in r.output and "14:03:12" in r.output


def test_terminal_summary(tmp_path):
    r = runner.invoke(cli.app, ["explain", str(SCENARIOS / "dated_system_prompt.yaml"), "--top", "3"])
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split())
    assert "Largest avoidable loss: diverged" in flat
    assert "position 33:" in flat and "11 request(s)" in flat and "move what varies after the shared part" in flat


def test_a_saved_run_explains_like_its_scenario(tmp_path):
    src = SCENARIOS / "small_pool.yaml"
    run_json = tmp_path / "run.json"
    r = runner.invoke(cli.app, ["simulate", str(src), "--no-progress", "--json", str(run_json)])
    assert r.exit_code == 0, r.output
    a = explain(src, tmp_path=tmp_path)
    b = explain(run_json, tmp_path=tmp_path)
    assert a["runs"] == b["runs"] and a["divergences"] == b["divergences"]
    reasons = explain(SCENARIOS / "reasoning_history.yaml", tmp_path=tmp_path)
    runner.invoke(cli.app, ["simulate", str(SCENARIOS / "reasoning_history.yaml"), "--json", str(run_json)])
    assert explain(run_json, tmp_path=tmp_path)["divergences"] == reasons["divergences"]
    req = explain(run_json, "--request", 5, tmp_path=tmp_path)["request"]
    assert req["divergence"]["example"] == 5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--request", "99"], "the run has 12 requests"),
        (["--top", "0"], "--top must be >= 1"),
        (["--request", "-1"], "--request must be >= 0"),
    ],
)
def test_user_errors(args, message):
    r = runner.invoke(cli.app, ["explain", str(SCENARIOS / "dated_system_prompt.yaml"), *args])
    assert r.exit_code == 2 and message in " ".join(r.output.split())


def test_options_do_not_apply_to_a_saved_run(tmp_path):
    run_json = tmp_path / "run.json"
    runner.invoke(cli.app, ["simulate", str(SCENARIOS / "short_system_prompt.yaml"), "--json", str(run_json)])
    r = runner.invoke(cli.app, ["explain", str(run_json), "--capacity", "1024"])
    assert r.exit_code == 2 and "--capacity" in r.output


def test_a_record_without_causes_still_loads_and_renders(tmp_path):
    sc = load_scenario(SCENARIOS / "short_system_prompt.yaml")
    results = simulate(from_scenario(sc, 16), [Capacity(None)], causes=False)
    path = tmp_path / "old.json"
    save_record(build_record("simulate", "old", {}, results), path)
    raw = json.loads(path.read_text())
    for col in ("cold_tokens", "evicted_tokens", "shared_with"):  # a record written before the causes existed
        del raw["runs"][0]["rows"][col]
    del raw["divergences"]
    path.write_text(json.dumps(raw))
    rec = load_record(path)
    assert rec.runs[0].rows[0].cold_tokens is None and rec.divergences == ()
    r = runner.invoke(cli.app, ["explain", str(path)])
    assert r.exit_code == 0 and "no miss causes" in r.output
    r = runner.invoke(cli.app, ["report", str(path), "--html", str(tmp_path / "old.html")])
    assert r.exit_code == 0 and "Why prefill was not saved" not in (tmp_path / "old.html").read_text()


# ---- the report section -------------------------------------------------------------------------------------------
class Sections(HTMLParser):
    """The h2 sections of an HTML report: per section its images and tables (rows of cell texts)."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, dict] = {}
        self.current: dict | None = None
        self.tag: str | None = None

    def handle_starttag(self, tag, attrs):
        self.tag = tag
        if tag == "h2":
            self.current = {"title": "", "images": [], "tables": []}
        elif self.current is not None and tag == "img":
            self.current["images"].append(dict(attrs))
        elif self.current is not None and tag == "table":
            self.current["tables"].append([])
        elif self.current is not None and tag == "tr" and self.current["tables"]:
            self.current["tables"][-1].append([])

    def handle_data(self, data):
        if self.tag == "h2" and self.current is not None:
            self.current["title"] += data
            self.sections[self.current["title"]] = self.current
        elif self.tag in ("td", "th") and self.current is not None and self.current["tables"]:
            self.current["tables"][-1][-1].append(data)


def test_report_section_in_html_and_markdown(tmp_path):
    html_path, md_path, run_json = tmp_path / "r.html", tmp_path / "r.md", tmp_path / "run.json"
    r = runner.invoke(
        cli.app,
        [
            "simulate",
            str(SCENARIOS / "dated_system_prompt.yaml"),
            "-c",
            "4096",
            "-c",
            "unlimited",
            "--json",
            str(run_json),
        ],
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli.app, ["report", str(run_json), "--html", str(html_path), "--markdown", str(md_path)])
    assert r.exit_code == 0, r.output
    parser = Sections()
    parser.feed(html_path.read_text())
    why = parser.sections["Why prefill was not saved"]
    (img,) = why["images"]
    assert img["src"].startswith("data:image/png;base64,") and img["alt"] == "Uncached tokens by cause"
    causes, sites = why["tables"]
    assert causes[0] == ["tokens", "4,096 tok", "unlimited"]
    assert any(row[0].strip() == "diverged" for row in causes)
    rec = load_record(run_json)
    assert sites[1][:4] == ["1", "33", "11", f"{rec.divergences[0].tokens:,}"]
    md = md_path.read_text()
    assert "## Why prefill was not saved" in md and f"({md_path.stem}_causes.png)" in md
    assert (tmp_path / f"{md_path.stem}_causes.png").read_bytes().startswith(b"\x89PNG")
    assert to_json(rec)["divergences"][0]["position"] == 33
