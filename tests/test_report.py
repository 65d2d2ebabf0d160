"""Run records and reports: totals from hand-made rows, percentiles against numpy, Markdown/HTML output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from prefixcache.core.errors import InputError
from prefixcache.reports.document import rich_table, write_html, write_markdown
from prefixcache.reports.record import build_record, load_record, save_record, to_json
from prefixcache.reports.run_report import document, figures, summary
from prefixcache.sim.policy import Capacity
from prefixcache.sim.results import Row, RunResult, totals


def _rows(timed: bool = False) -> list[Row]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(40):
        prompt = int(rng.integers(20, 200))
        hit = int(rng.integers(0, prompt // 16))
        t = (
            dict(
                ttft_cached_s=float(rng.uniform(0.01, 0.05)),
                total_cached_s=0.2,
                ttft_uncached_s=float(rng.uniform(0.05, 0.2)),
                total_uncached_s=0.4,
                outputs_match=i != 7,
                output_tokens=8,
            )
            if timed
            else {}
        )
        out.append(
            Row(i, "default", prompt, hit * 16, -(-prompt // 16), hit, 2, i % 3, min(30, i), i < 4, float(i), **t)
        )
    return out


def test_totals_by_hand():
    rows = _rows(timed=True)
    t = totals(rows, Capacity(32), 32, 16)
    m = rows[4:]  # warm-up rows excluded
    assert t["requests"] == 36
    assert t["prompt_tokens"] == sum(r.prompt_tokens for r in m)
    assert t["token_hit_rate"] == pytest.approx(sum(r.cached_tokens for r in m) / sum(r.prompt_tokens for r in m))
    assert t["block_hit_rate"] == pytest.approx(sum(r.hit_blocks for r in m) / sum(r.blocks for r in m))
    assert t["hit_request_share"] == pytest.approx(sum(r.hit_blocks > 0 for r in m) / 36)
    assert t["evicted_blocks"] == sum(i % 3 for i in range(4, 40))
    assert t["peak_pool_blocks"] == 30 and t["peak_pool_occupancy"] == pytest.approx(30 / 32)
    for q in (50, 90, 99):
        assert t[f"ttft_cached_p{q}_s"] == pytest.approx(np.percentile([r.ttft_cached_s for r in m], q))
        assert t[f"ttft_uncached_p{q}_s"] == pytest.approx(np.percentile([r.ttft_uncached_s for r in m], q))
    assert t["ttft_speedup_p50"] == pytest.approx(t["ttft_uncached_p50_s"] / t["ttft_cached_p50_s"])
    assert t["outputs_checked"] == 36 and t["outputs_mismatched"] == 1


def test_record_round_trip_and_documents(tmp_path):
    results = [
        RunResult(Capacity(32), 32, 16, tuple(_rows(True))),
        RunResult(Capacity(64), 64, 16, tuple(_rows(True))),
    ]
    rec = build_record("replay", "x.yaml", {"model": "tiny"}, results)
    save_record(rec, tmp_path / "r.json")
    back = load_record(tmp_path / "r.json")
    assert back == rec and to_json(back) == json.loads(json.dumps(to_json(rec)))
    assert [t["capacity_tokens"] for t in back.totals()] == [512, 1024]
    stems = [f.stem for f in figures(back)]
    assert stems == ["hit_rate", "tokens_saved", "ttft", "capacity"]
    write_html(document(back), tmp_path / "r.html")
    html = (tmp_path / "r.html").read_text()
    assert html.count("data:image/png;base64,") == 4 and "TTFT p50" in html
    files = write_markdown(document(back), tmp_path / "r.md")
    assert len(files) == 5 and all(Path(f).exists() for f in files)
    text = Console(width=200, record=True)
    text.print(rich_table(summary(back)))
    out = text.export_text()
    assert "TTFT speedup" in out and "35/36" in out and "512 tok" in out


def test_load_record_rejects_unknown_row_keys(tmp_path):
    raw = to_json(build_record("simulate", "x", {}, [RunResult(Capacity(8), 8, 16, tuple(_rows()))]))
    cols = raw["runs"][0]["rows"]
    raw["runs"][0]["rows"] = [dict(zip(cols, values)) for values in zip(*cols.values())]  # version 1: row objects
    raw["version"] = 1
    raw["runs"][0]["rows"][3]["surprise"] = 1
    (tmp_path / "r.json").write_text(json.dumps(raw))
    with pytest.raises(InputError, match=r"rows\[3\]: unknown key 'surprise'"):
        load_record(tmp_path / "r.json")
    raw["runs"][0]["rows"][3].pop("surprise")
    (tmp_path / "r.json").write_text(json.dumps(raw))
    assert load_record(tmp_path / "r.json").runs[0].rows == tuple(_rows())  # version 1 still loads
