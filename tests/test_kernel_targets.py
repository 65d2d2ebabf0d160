"""The C libraries' builds for CPUs other than this one, on a CPU with AVX-512 and AVX512-BF16: built for
``x86-64-v3`` (AVX2 + FMA: AMD Zen 2/3, most Intel client CPUs) and for ``skylake-avx512`` (AVX-512 without
AVX512-BF16: Intel servers Skylake to Ice Lake) through ``kernel.target_flags`` (``PREFIXCACHE_KERNEL_MARCH``), they
pass the kernels' own tests with oneDNN held to what such a CPU has (``ONEDNN_MAX_CPU_ISA``; at AVX2 it packs no
bf16, so bf16 linears run on the small-row kernel alone); and their bf16 small-row linears, which widen the pairs
instead of vdpbf16ps, give the AVX512-BF16 build's bits; and with oneDNN's bf16 emulated, a bf16 model still gets
its engine (``runner.own_difference``). Elsewhere the kernels' tests run this CPU's own builds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.paged import kernel, linear, runner

AVX2 = "x86-64-v3"
# target: (oneDNN's and torch's ISA there, small_linear_available(), whether the attention's prefill path is the
# 8-lane one); neither has the bf16 prefill path (AVX512-BF16)
TARGETS = {
    AVX2: (("AVX2", "avx2"), 1 | 2 | linear.AVX2_BUILD | linear.WIDE_BF16, True),
    "skylake-avx512": (("AVX512_CORE", "avx512"), 1 | 2 | linear.WIDE_BF16, False),
}
ROOT = Path(__file__).resolve().parents[1]


def _flags() -> set[str]:
    try:
        return set(next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split())
    except (OSError, StopIteration):
        return set()


pytestmark = pytest.mark.skipif(
    not {"avx512f", "avx512_bf16", "avx2", "fma"} <= _flags() or os.environ.get("PREFIXCACHE_KERNEL_MARCH") is not None,
    reason="needs a CPU with AVX512-BF16 (elsewhere the kernels' tests run this CPU's own builds)",
)


@pytest.mark.parametrize("march", list(TARGETS))
def test_widened_bf16_small_rows_give_the_avx512_bf16_builds_bits(march):
    """Each pair of k widened and added odd k first, by fmas, as vdpbf16ps adds them: the same bits, rounding to
    bf16 (ties to even, NaN, overflow to inf) included."""
    native, other = kernel.load_small_linear(), kernel.load_small_linear(march=march)
    assert other is not None, kernel.unavailable_reason(f"small_linear_{march}")
    assert int(other.small_linear_available()) == TARGETS[march][1]
    assert native is not None and int(native.small_linear_available()) == 1 | 2
    g = torch.Generator().manual_seed(0)
    for n, k, rows in ((48, 96, (1, 5, 6, 7, 40)), (256, 1024, (2, 13, 256))):
        net = torch.nn.Linear(k, n)
        with torch.no_grad():
            net.bias[:3] = torch.tensor([float("nan"), 3.0e38, -float("inf")])
        net = net.to(torch.bfloat16)
        a, b = linear.small_packed(native, net), linear.small_packed(other, net)
        assert a is not None and b is not None
        for m in rows:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            x[0, :4] = torch.tensor([3.0e38, 3.0e38, 1e-3, -2.0])  # sums past float32's range in some outputs
            ya, yb = a(x), b(x)
            assert ya is not None and yb is not None
            assert torch.equal(ya.view(torch.int16), yb.view(torch.int16)), (n, k, m)
            assert torch.isnan(yb[:, 0]).all() and torch.isinf(yb[:, 2]).all()


@pytest.mark.parametrize("march", list(TARGETS))
def test_the_kernels_tests_pass_with_the_builds_for_another_cpu(march):
    """tests/test_paged_attention.py, test_paged_linear.py and test_fused_ops.py in a fresh process whose libraries
    are the builds for ``march`` (checked there) and whose oneDNN stops at that CPU's ISA."""
    (isa, aten), small, eight_lanes = TARGETS[march]
    env = dict(os.environ, PREFIXCACHE_KERNEL_MARCH=march, ONEDNN_MAX_CPU_ISA=isa, ATEN_CPU_CAPABILITY=aten)
    check = (
        "import torch; from engine.paged import kernel, linear; "
        "s, a = kernel.load_small_linear(), kernel.load(); "
        f"assert int(s.small_linear_available()) == {small} and kernel.prefill_8lane(a) == {eight_lanes}; "
        "assert not kernel.prefill_available(a, torch.bfloat16); "
        f"assert (linear.onednn_refuses(torch.bfloat16) is None) == {isa != 'AVX2'}"
    )
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    files = ["tests/test_paged_attention.py", "tests/test_paged_linear.py", "tests/test_fused_ops.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_a_bf16_engine_where_onednn_emulates_bf16():
    """With oneDNN held to AVX-512 without its bf16 instructions (Intel Skylake to Ice Lake servers), its bf16
    results depend on a call's row count, so the model's own forward in the probe's two chunks moves from its one
    pass by about a bf16 ulp, and the paged probe by as much: the engine takes that as its bar (``own_difference``)
    and is made, where the 1e-3 tolerance alone refused it."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX512_CORE_VNNI")
    script = (
        "import json, torch\n"
        "from engine import PrefixCachedModel\n"
        "from engine.paged import runner\n"
        "pcm = PrefixCachedModel.from_pretrained('small', dtype=torch.bfloat16, max_cached_tokens=1024)\n"
        "rt = pcm.runtime\n"
        "with rt.cache.borrowed_blocks(4) as blocks:\n"
        "    probe = runner.probe_difference(pcm.model, rt.pool, blocks)\n"
        "    own = runner.own_difference(pcm.model, rt.pool, blocks)\n"
        "print(json.dumps({'probe': probe, 'own': own, 'engine': rt.engine() is not None}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["own"] is not None and got["own"] > runner.PROBE_TOLERANCE, got  # the library moves by itself
    assert runner.PROBE_TOLERANCE < got["probe"] <= runner.OWN_DIFFERENCE_SLACK * got["own"], got
    assert got["engine"], got
