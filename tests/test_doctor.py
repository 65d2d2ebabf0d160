"""``prefixcache doctor``: the installed versions and, per model, each path's status as the checks at load decided
it, as a table and as JSON; on a simulated upstream change it reports the path uncached with the reason."""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path

import pytest
import torch
from transformers.cache_utils import LinearAttentionLayer
from typer.testing import CliRunner

from prefixcache.cli import app

runner = CliRunner()


def _doctor(tmp_path, *models: str) -> dict:
    out = tmp_path / "doctor.json"
    args = ["doctor", *[a for m in models for a in ("--model", m)], "--json", str(out)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "installed" in res.output and "transformers" in res.output
    return json.loads(out.read_text())


def test_doctor_reports_versions_and_exact_paths(tmp_path):
    found = _doctor(tmp_path, "tiny")
    assert found["versions"]["transformers"] == metadata.version("transformers")
    assert found["versions"]["torch"] == metadata.version("torch")
    (tiny,) = found["models"]
    assert tiny["class"] == "LlamaForCausalLM" and not tiny["hybrid"]
    assert [p["status"] for p in tiny["paths"]] == ["cached, exact", "cached, exact"]
    assert tiny["warnings"] == []


def test_doctor_names_what_an_upstream_change_turned_off(tmp_path, monkeypatch):
    init = LinearAttentionLayer.__init__

    def gains_a_tensor(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.chunk_offsets = torch.zeros(1, dtype=torch.long)

    monkeypatch.setattr(LinearAttentionLayer, "__init__", gains_a_tensor)
    (hybrid,) = _doctor(tmp_path, "tiny-hybrid")["models"]
    assert {p["status"] for p in hybrid["paths"]} == {"uncached"}
    assert "chunk_offsets" in hybrid["paths"][0]["reason"] and "transformers " in hybrid["paths"][0]["reason"]
    assert any("caching is off" in w for w in hybrid["warnings"])


def test_doctor_refuses_an_unknown_model_in_one_line(tmp_path):
    res = runner.invoke(app, ["doctor", "--model", str(tmp_path / "nowhere")])
    assert res.exit_code == 2
    assert "neither a preset" in res.output


def test_doctor_reports_the_kernels_this_cpu_gets(tmp_path):
    """The kernels' section follows this CPU's flags (/proc/cpuinfo, read here) and oneDNN's own answer: 16 lanes
    with AVX-512, 8 with AVX2 and FMA; bf16 linears off oneDNN exactly where it raises packing them, on the
    small-row kernel where that has a build."""
    from engine.paged import kernel

    if os.environ.get("PREFIXCACHE_KERNEL_MARCH"):
        pytest.skip("PREFIXCACHE_KERNEL_MARCH builds for another CPU than /proc/cpuinfo's")

    found = _doctor(tmp_path, "tiny")
    kernels = found["cpu_kernels"]
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags")
    if kernel.load() is None:
        assert "unavailable" in kernels["attention kernel"]
        return
    want = "16-lane" if "avx512f" in flags else "8-lane" if {"avx2", "fma"} <= set(flags) else "scalar"
    assert kernels["attention: decoding rows"].startswith(want)
    assert kernels["attention: float32 prefill rows"].startswith(want if want != "scalar" else "torch's SDPA")
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 16)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 16, dtype=torch.bfloat16), w, None, "none", [], "")
        bf16_packs = True
    except RuntimeError:
        bf16_packs = False
    assert kernels["linears: bfloat16"].startswith("oneDNN") == bf16_packs
    if not bf16_packs and want != "scalar":
        assert kernels["linears: bfloat16"].startswith(f"the small-row kernel, {want}")
