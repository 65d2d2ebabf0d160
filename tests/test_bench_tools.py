"""The benchmarks' helpers: the roofline's FLOP count (benchmarks/_roofline.py) against the model's shapes counted by
hand, and serve_sweep's shapes and per-shape rows (ratios, cores busy, targets) from a serve_peers summary."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import serve_sweep  # noqa: E402

import _roofline  # noqa: E402
from engine.models import build_preset  # noqa: E402


def test_forward_flops_counts_linears_head_and_attention() -> None:
    model, _ = build_preset("tiny")
    cfg = model.config
    h, i, heads, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or h // heads
    kv = cfg.num_key_value_heads * hd
    per_layer = h * heads * hd + 2 * h * kv + heads * hd * h + 3 * h * i  # q, k, v, o; gate, up, down
    expected = 2 * layers * per_layer * 10 + 2 * h * cfg.vocab_size * 3 + 4 * layers * heads * hd * 55
    assert _roofline.forward_flops(model, tokens=10, logit_rows=3, attention_pairs=55) == pytest.approx(expected)


def test_mm_gflops_is_positive() -> None:
    assert _roofline.mm_gflops([(4, 8, 8)], min_s=0.01) > 0


def test_sweep_shapes_and_rows() -> None:
    shapes = serve_sweep.all_shapes()
    assert len(shapes) == 18 and "12x16x300" in shapes and "4x64x600" in shapes
    assert serve_sweep.parse_shape("8x32x600") == (8, 32, 600)
    with pytest.raises(SystemExit):
        serve_sweep.parse_shape("8x32")

    def summary(server: str, rps: float, p99: float, cpu: float) -> dict:
        return {
            "phase": "closed",
            "server": server,
            "requests_per_s_median": rps,
            "ttft_p50_ms": p99 / 2,
            "ttft_p99_ms": p99,
            "server_cpu_s_per_request": cpu,
        }

    data = {"summary": [summary("pc", 5.0, 900.0, 0.38), summary("vllm2", 4.0, 1000.0, 0.45)]}
    row = serve_sweep.shape_row("12x16x300", data, ["pc", "vllm2"])
    assert row["requests_per_s_ratio"] == pytest.approx(1.25) and row["ttft_p99_ratio"] == pytest.approx(0.9)
    assert row["servers"]["pc"]["cores_busy"] == pytest.approx(1.9)
    assert row["targets_met"] == {"requests_per_s_ratio": True, "ttft_p99": True, "cores_busy": True}
    only_pc = serve_sweep.shape_row("12x16x300", {"summary": data["summary"][:1]}, ["pc"])
    assert "requests_per_s_ratio" not in only_pc and only_pc["targets_met"] == {"cores_busy": True}
