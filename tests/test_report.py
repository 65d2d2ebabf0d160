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


def _two_identical_runs(n_rows: int | None = None) -> object:
    rows = tuple(_rows(True))[: n_rows or None]
    results = [RunResult(Capacity(128), 128, 16, rows), RunResult(Capacity(None), 300, 16, rows)]
    settings = {
        "model": "tiny",
        "baseline": True,
        "verify": False,
        "dtype": "torch.float32",
        "capacities": ["2,048 tokens (128 blocks)", "unlimited"],
        "block_size": 16,
        "warmup": 0.0,
        "keep_for": None,
        "guard": {"abs_threshold": 131072, "rel_threshold": 1.5},
    }
    return build_record("replay", "x.yaml", settings, results)


def test_settings_are_formatted_for_people():
    from prefixcache.reports import format as fmt

    rec = _two_identical_runs()
    table = next(s for s in document(rec).sections if s.title == "Settings").blocks[0]
    got = dict(map(tuple, table.rows))
    assert got == {
        "model": "tiny",
        "baseline": "yes",
        "verify": "no",
        "dtype": "float32",
        "capacities": "2,048 tokens (128 blocks), unlimited",
        "block size": "16",
        "warmup": "0",
        "keep for": fmt.NONE,
        "guard": "abs threshold: 131,072, rel threshold: 1.5",
    }


def test_hit_rate_lines_of_identical_runs_stay_distinguishable():
    from prefixcache.reports.run_report import hit_rate_series

    series, window = hit_rate_series(_two_identical_runs())
    solid = [s for s in series if not s.faint]
    assert [s.label for s in solid] == ["2,048 tok", "unlimited"]
    a, b = solid
    assert a.y == b.y  # they cache identically ...
    assert (a.line, a.marker, a.color) != (b.line, b.marker, b.color)  # ... yet each has its own style
    assert a.line != b.line and a.marker != b.marker and a.mark_from != b.mark_from  # and staggered markers


def test_the_moving_window_is_drawn_exactly_when_the_title_says_so():
    from prefixcache.reports.run_report import hit_rate_series, hit_rate_title

    series, window = hit_rate_series(_two_identical_runs())  # 36 measured requests
    assert window == 5 and "moving window of 5 requests" in hit_rate_title(window)
    faint = [s for s in series if s.faint]
    assert len(faint) == 2 and all(len(s.x) == 36 - 5 + 1 for s in faint)
    rows = _rows(True)[4:9]  # the first 5 measured requests (4 are warm-up), by hand: the window's first value
    assert faint[0].y[0] == pytest.approx(sum(r.cached_tokens for r in rows) / sum(r.prompt_tokens for r in rows))
    series, window = hit_rate_series(_two_identical_runs(n_rows=12))  # 8 measured: too few for a window
    assert window is None and not any(s.faint for s in series)
    assert "window" not in hit_rate_title(window)


def test_ttft_scatter_has_a_cached_and_an_uncached_series_per_column():
    from prefixcache.reports.run_report import capacity_label, ttft_series

    rec = _two_identical_runs()
    series = ttft_series(rec)
    columns = [capacity_label(t) for t in rec.totals()]  # the summary table's columns
    assert [s.label for s in series] == [f"{kind}, {c}" for c in columns for kind in ("cached", "uncached")]
    m = _rows(True)[4:]
    assert series[1].y == tuple(1000 * r.ttft_uncached_s for r in m)
    assert series[0].color == series[1].color != series[2].color  # a column's two series share its colour


def _cause_rows(no_state: bool = True) -> list[Row]:
    """Three rows of 48 prompt tokens, their uncached tokens split by hand: cold, and (``no_state``) 16 tokens of
    the last row whose KV was cached but no snapshot reached (else cold too)."""
    rows = []
    for i, cached in enumerate((16, 0, 16)):
        ns = 16 if no_state and i == 2 else 0
        zero = dict.fromkeys(("evicted", "diverged", "partial_block", "namespace", "not_cached"), 0)
        causes = {f"{c}_tokens": v for c, v in zero.items()}
        row = Row(i, "default", 48, cached, 3, cached // 16, 0, 0, 3, shared_tokens=0, **causes)
        rows.append(row._replace(cold_tokens=48 - cached - ns, no_state_tokens=ns))
    return rows


def test_no_state_round_trips_and_older_records_load_with_zero(tmp_path):
    from prefixcache.reports.causes_report import cause_table

    rec = build_record("replay", "x.yaml", {}, [RunResult(Capacity(8), 8, 16, tuple(_cause_rows()))])
    save_record(rec, tmp_path / "r.json")
    raw = json.loads((tmp_path / "r.json").read_text())
    assert raw["version"] == 4 and raw["runs"][0]["rows"]["no_state_tokens"] == [0, 0, 16]
    back = load_record(tmp_path / "r.json")
    assert back == rec and back.totals()[0]["no_state_tokens"] == 16
    assert ["  no_state", "16 (11.1%)"] in cause_table(back).rows  # 16 of 144 prompt tokens
    # the causes must still add up to the uncached tokens
    raw["runs"][0]["rows"]["no_state_tokens"][2] = 15
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(InputError, match="add up"):
        load_record(tmp_path / "bad.json")
    # version 3 (and 1, 2) wrote no such column: rows with causes load with 0, rows without with null
    plain = build_record("replay", "x.yaml", {}, [RunResult(Capacity(8), 8, 16, tuple(_cause_rows(False)))])
    old = to_json(plain)
    old["version"] = 3
    del old["runs"][0]["rows"]["no_state_tokens"]
    (tmp_path / "v3.json").write_text(json.dumps(old))
    loaded = load_record(tmp_path / "v3.json")
    assert loaded.runs == plain.runs and [r.no_state_tokens for r in loaded.runs[0].rows] == [0, 0, 0]
    assert not any(row[0] == "  no_state" for row in cause_table(loaded).rows)  # a line only when non-zero
    no_causes = to_json(build_record("simulate", "x", {}, [RunResult(Capacity(8), 8, 16, tuple(_rows()))]))
    no_causes["version"] = 2
    del no_causes["runs"][0]["rows"]["no_state_tokens"]
    (tmp_path / "v2.json").write_text(json.dumps(no_causes))
    assert all(r.no_state_tokens is None for r in load_record(tmp_path / "v2.json").runs[0].rows)
