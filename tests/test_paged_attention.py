"""``paged_attention`` against a contiguous brute-force attention written here, on random shapes and block tables.

Each example draws 1-3 rows (new tokens ``q_len``, length after the step ``kv_len``), a head layout (grouped-query
attention included), a head dim, a block size (1, 5, 16), an optional logit soft-cap and sliding window, and gives
every row a block table of distinct pool blocks in random order (extra blocks past the row's end included). The
pool starts full of random garbage; each row's past keys and values are written straight into its blocks (slot =
block * block_size + offset) and its new ones go in through ``PagedKV.update``, as in a forward. The result must
equal, within 1e-5, a float64 reference that takes each row's keys and values as plain contiguous tensors: scores
q.k * scale, optional softcap * tanh(s / softcap), query position p = kv_len - q_len + i attends keys j <= p (and
j > p - window with a window), softmax, weighted sum; query head h reads kv head h // (Hq / Hkv). Both the C kernel
(rows with few new tokens) and the torch path (every row, ``use_kernel=False``) are checked, and ``update`` must
write the new tokens' slots and nothing else. A second property checks ``fresh_from``: recomputed positions write
to the scratch block only; the rows' blocks keep what they held.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv_pool import KVPool, LayerSpec
from engine.paged import attention as att
from engine.paged import kernel
from engine.paged.attention import KERNEL_MAX_QUERIES, PagedKV, Row, StepBatch, paged_attention, use_batch

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


def reference(q, k, v, kv_len, scale, softcap, window):
    """Brute-force attention of one row: q [Hq, q_len, D], k and v [Hkv, kv_len, D] -> [q_len, Hq, D] (float64)."""
    q, k, v = q.double(), k.double(), v.double()
    hq, q_len, dim = q.shape
    group = hq // k.shape[0]
    pos = torch.arange(kv_len - q_len, kv_len)[:, None]  # query i's position
    key = torch.arange(kv_len)[None, :]
    allowed = (key <= pos) & ((key > pos - window) if window else True)
    out = torch.zeros((q_len, hq, dim), dtype=torch.float64)
    for h in range(hq):
        s = (q[h] @ k[h // group].T) * scale  # [q_len, kv_len]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        w = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=1)
        out[:, h] = w @ v[h // group]
    return out


def pool_view(side: torch.Tensor, bs: int) -> torch.Tensor:
    """A pool layer side [heads, num_blocks + 1, bs * dim] as [heads, slots, dim]."""
    heads, _, width = side.shape
    return side.view(heads, -1, width // bs)


@st.composite
def cases(draw, long_rows: bool = False):
    bs = draw(st.sampled_from([1, 5, 16]))
    hkv = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([g for g in (1, 2, 4) if hkv * g <= 4]))  # 1-4 query heads, GQA groups 1-4
    dim = draw(st.sampled_from([8, 16, 64]))
    nrows = draw(st.integers(1, 3))
    shapes = []
    for _ in range(nrows):
        q_len = draw(st.one_of(st.integers(1, KERNEL_MAX_QUERIES), st.integers(1, 12)))
        if long_rows and draw(st.booleans()):  # a prefill row: one, two or three tiles of 32 queries
            q_len = draw(st.integers(KERNEL_MAX_QUERIES + 1, 80))
        kv_len = draw(st.integers(q_len, q_len + 70))
        extra = draw(st.integers(0, 2))  # blocks past the row's end: never read
        shapes.append((q_len, kv_len, -(-kv_len // bs) + extra))
    spare = draw(st.integers(0, 4))
    num_blocks = sum(n for *_, n in shapes) + spare
    perm = draw(st.permutations(range(num_blocks)))
    tables, at = [], 0
    for *_, n in shapes:
        tables.append(list(perm[at : at + n]))
        at += n
    softcap = draw(st.sampled_from([None, None, 1.5, 20.0]))
    window = draw(st.sampled_from([None, None, 1, 3, 7, 20]))
    scale = draw(st.sampled_from([None, 0.3, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    split = draw(st.sampled_from([3, 16, att.KERNEL_SPLIT]))  # the kernel's softmax splits: several per row, or one
    return bs, hkv, hkv * group, dim, shapes, tables, num_blocks, softcap, window, scale, seed, split


def run_case(case, use_kernel: bool, dtype: torch.dtype = torch.float32, tol: float = 1e-5):
    """One drawn case through ``paged_attention`` against ``reference``; a bf16 pool holds the rows' K/V rounded to
    bf16 (the reference takes the rounded values too) and the queries are bf16."""
    bs, hkv, hq, dim, shapes, tables, num_blocks, softcap, window, scale, seed, split = case
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool([LayerSpec((hkv, dim), (hkv, dim))], num_blocks, bs, dtype=dtype, device="cpu")
    kpool, vpool = pool.layer(0)
    kpool.copy_(torch.randn(kpool.shape, generator=gen) * 3)  # garbage wherever the rows do not write
    vpool.copy_(torch.randn(vpool.shape, generator=gen) * 3)
    kview, vview = pool_view(kpool, bs), pool_view(vpool, bs)
    rows, keys, values, new_k, new_v, new_slots = [], [], [], [], [], []
    t = 0
    for (q_len, kv_len, _), table in zip(shapes, tables):
        k = torch.randn((hkv, kv_len, dim), generator=gen).to(dtype)
        v = torch.randn((hkv, kv_len, dim), generator=gen).to(dtype)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(kv_len)])
        first = kv_len - q_len
        kview[:, slots[:first]] = k[:, :first]  # the past: already in the pool
        vview[:, slots[:first]] = v[:, :first]
        new_k.append(k[:, first:])
        new_v.append(v[:, first:])
        new_slots.append(slots[first:])
        keys.append(k)
        values.append(v)
        rows.append(Row(t, q_len, kv_len, table))
        t += q_len
    query = torch.randn((1, hq, t, dim), generator=gen).to(dtype)
    before_k, before_v = kview.clone(), vview.clone()
    batch = StepBatch.make(pool, rows, use_kernel=use_kernel)
    if use_kernel and (dtype == torch.float32 or len(rows) > 1):
        # the prefill path: bf16 rows of PREFILL_MIN_QUERIES or more; fp32 ones of PREFILL_MIN_QUERIES_F32 or more,
        # beside other rows only; where the library has that path. The rest: short ones the decode path, long SDPA
        # (the 8-lane build: rows of at most PREFILL_MAX_QUERIES_8LANE; longer ones SDPA too)
        built = kernel.prefill_available(kernel.load(), dtype)
        least = att.PREFILL_MIN_QUERIES if dtype == torch.bfloat16 else att.PREFILL_MIN_QUERIES_F32
        most = att.PREFILL_MAX_QUERIES_8LANE if kernel.prefill_8lane(kernel.load()) else math.inf
        if not built or (dtype == torch.float32 and len(rows) == 1):
            least = math.inf
        prefill = [i for i, r in enumerate(rows) if least <= r.q_len <= most]
        assert batch.prefill_rows == prefill
        short = [i for i, r in enumerate(rows) if i not in prefill and r.q_len <= KERNEL_MAX_QUERIES]
        assert batch.kernel_rows == short
        assert batch.torch_rows == [i for i in range(len(rows)) if i not in prefill and i not in short]
    else:  # no kernel asked for, or a bf16 row alone in its step (SDPA: the bare model's call)
        assert batch.kernel_rows == batch.prefill_rows == [] and batch.torch_rows == list(range(len(rows)))
    PagedKV(batch).update(torch.cat(new_k, dim=1)[None], torch.cat(new_v, dim=1)[None], layer_idx=0)
    assert batch.layer == 0
    # update wrote exactly the new tokens' slots
    written = torch.cat(new_slots)
    untouched = torch.ones(kview.shape[1], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(kview[:, untouched], before_k[:, untouched])
    assert torch.equal(vview[:, untouched], before_v[:, untouched])
    assert torch.equal(kview[:, written], torch.cat(new_k, dim=1))
    assert torch.equal(vview[:, written], torch.cat(new_v, dim=1))
    by_torch: list[int] = []  # rows the torch path attended
    torch_attention = att._torch_attention

    def spy(b, i, *args):
        by_torch.append(i)
        return torch_attention(b, i, *args)

    with use_batch(batch), pytest.MonkeyPatch.context() as mp:
        mp.setattr(att, "KERNEL_SPLIT", split)
        mp.setattr(att, "_torch_attention", spy)
        out, weights = paged_attention(
            torch.nn.Identity(), query, None, None, None, scaling=scale, sliding_window=window, softcap=softcap
        )
    assert weights is None
    assert out.shape == (1, t, hq, dim)
    if batch.prefill_rows and dim % 16 == 0 and not softcap:  # the prefill path served its rows (head dims of 16k)
        assert not set(by_torch) & set(batch.prefill_rows)
    if batch.prefill_rows and softcap and dtype == torch.float32:  # soft-capped: the short ones by the decode path
        assert {i for i in batch.prefill_rows if rows[i].q_len > KERNEL_MAX_QUERIES} <= set(by_torch)
        assert not {i for i in batch.prefill_rows if rows[i].q_len <= KERNEL_MAX_QUERIES} & set(by_torch)
    eff_scale = scale if scale is not None else 1.0 / math.sqrt(dim)
    for r, k, v in zip(rows, keys, values):
        q = query[0, :, r.q_start : r.q_start + r.q_len]
        want = reference(q, k, v, r.kv_len, eff_scale, softcap, window)
        got = out[0, r.q_start : r.q_start + r.q_len].double()
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: f"row {r}: {m}")


@SETTINGS
@given(case=cases())
def test_torch_path_equals_contiguous_reference(case):
    run_case(case, use_kernel=False)


@SETTINGS
@given(case=cases(long_rows=True))
def test_kernel_equals_contiguous_reference(case):
    """float32: the decode path, and the prefill path for rows of ``PREFILL_MIN_QUERIES_F32`` new tokens or more in
    steps of several rows (a head dim not a multiple of 16 sends those to the torch path; with a soft-cap, those of
    at most ``KERNEL_MAX_QUERIES`` take the decode path, longer ones the torch path)."""
    if kernel.load() is None:
        pytest.skip(f"no C kernel: {kernel.unavailable_reason()}")
    run_case(case, use_kernel=True)


@SETTINGS
@given(case=cases(long_rows=True))
def test_8lane_prefill_path_on_rows_of_any_length(case):
    """The prefill path's 8-lane (AVX2) build, which the engine sends rows of at most ``PREFILL_MAX_QUERIES_8LANE``
    new tokens, computes longer ones right too (several tiles, groups of tiles, quarters of a tile)."""
    if kernel.load() is None or not kernel.prefill_8lane(kernel.load()):
        pytest.skip("the prefill path here is not the 8-lane build")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(att, "PREFILL_MAX_QUERIES_8LANE", math.inf)
        run_case(case, use_kernel=True)


@SETTINGS
@given(case=cases(long_rows=True))
def test_bf16_kernel_and_torch_path_equal_contiguous_reference(case):
    """bf16 pools: the kernel (steps of several rows) and SDPA (a lone row) within bf16 rounding of the float64
    reference over the same bf16 K/V (the output is rounded to bf16; the kernel's probabilities are too). No
    soft-cap here: bf16 soft-capped rows take the eager formula, whose bf16 scores (up to the cap, 20) move the
    weights by more than the output's rounding, as the bare model's eager attention does. Rows of more than
    ``KERNEL_MAX_QUERIES`` new tokens are drawn too: the kernel's bf16 prefill path (AVX512-BF16 dot products,
    tiles of 32 queries) serves them, and those of ``PREFILL_MIN_QUERIES`` or more, where the CPU has it; the
    torch path elsewhere."""
    if kernel.load() is None:
        pytest.skip(f"no C kernel: {kernel.unavailable_reason()}")
    case = case[:7] + (None,) + case[8:]
    run_case(case, use_kernel=True, dtype=torch.bfloat16, tol=3e-2)


def test_kernel_is_available_with_a_compiler():
    """The kernel tests above are not silently skipped where a C compiler exists."""
    import shutil

    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler")
    assert kernel.load() is not None, kernel.unavailable_reason()


def _decode_outputs(built, dtype, dim, bs, lengths, window, softcap, hkv=4, group=1):
    """The decode path of library ``built`` over one query per row of ``lengths`` keys, in scattered blocks of a
    seeded random pool: [rows, heads, dim]."""
    gen = torch.Generator().manual_seed(0)
    rows, nb = len(lengths), -(-max(lengths) // bs)
    pool = KVPool([LayerSpec((hkv, dim), (hkv, dim))], rows * nb + 8, bs, dtype=dtype, device="cpu")
    kp, vp = pool.layer(0)
    kp.normal_(generator=gen)
    vp.normal_(generator=gen)
    tables = torch.randperm(kp.shape[1], generator=gen)[: rows * nb].to(torch.int32).view(rows, nb).contiguous()
    q = (3 * torch.randn((rows, hkv * group, dim), generator=gen)).to(dtype).float()
    q_start, q_len = torch.arange(rows, dtype=torch.int32), torch.ones(rows, dtype=torch.int32)
    kv_len = torch.tensor(lengths, dtype=torch.int32)
    out = torch.empty((rows, hkv * group, dim))
    fn = built.paged_attention_bf16 if dtype == torch.bfloat16 else built.paged_attention_f32
    rc = fn(
        q.data_ptr(), q.stride(0), q.stride(1), kp.data_ptr(), vp.data_ptr(), kp.shape[1], bs, dim, hkv,
        hkv * group, tables.data_ptr(), nb, q_start.data_ptr(), q_len.data_ptr(), kv_len.data_ptr(), rows,
        dim**-0.5, softcap, window, 512, out.data_ptr(), 2,
    )  # fmt: skip
    assert rc == 0
    assert out.isfinite().all() and out.abs().sum() > 0
    return out


@pytest.mark.parametrize("defines", [("KV_AHEAD=1",), kernel.L1_PREFETCH, ("KV_SPREAD=0",)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefetch_distance_changes_no_output(dtype, defines):
    """The decode path asks for keys ``KV_AHEAD`` blocks ahead, into L2 (``KV_HINT``), fp32's a key's lines at a time
    (``KV_SPREAD``); built to ask one block ahead, into L1, or a block's lines at once (``load_variant``, as
    ``bench_decode_roofline.py`` times them) it computes the same bits: rows of scattered blocks, one query each, a
    sliding window whose first key lies inside a block, and a row shorter than the prefetch distance."""
    lib, near = kernel.load(), kernel.load_variant(*defines)
    if lib is None or near is None:
        pytest.skip(f"no C kernel: {kernel.unavailable_reason()}")
    for window in (0, 333):
        args = (dtype, 64, 16, [1100, 40, 700], window, 0.0)
        assert torch.equal(_decode_outputs(lib, *args), _decode_outputs(near, *args))


@pytest.mark.parametrize(
    ("dim", "bs", "softcap", "group"), [(64, 16, 0.0, 1), (128, 32, 0.0, 2), (48, 16, 30.0, 1), (64, 5, 0.0, 1)]
)
def test_spread_prefetch_changes_no_output(dim, bs, softcap, group):
    """fp32's decode path asks for a key's lines at a time (``KV_SPREAD``); built to ask for a block's at once it
    computes the same bits over head dims of 4, 8 and 3 vectors, blocks of 16, 32 and 5 keys, a logit soft-cap,
    grouped-query heads, sliding windows whose first key lies inside a block, rows of 1 to 1,100 keys."""
    lib, burst = kernel.load(), kernel.load_variant("KV_SPREAD=0")
    if lib is None or burst is None:
        pytest.skip(f"no C kernel: {kernel.unavailable_reason()}")
    for window in (0, 21, 333):
        args = (torch.float32, dim, bs, [1100, 1, 17, 40, 700, 513], window, softcap, 2, group)
        assert torch.equal(_decode_outputs(lib, *args), _decode_outputs(burst, *args))


@pytest.mark.parametrize(
    ("dtype", "defines", "dim"),
    [
        (torch.float32, kernel.PREFILL_PLAIN, 64),
        (torch.bfloat16, kernel.PREFILL_PLAIN, 64),
        (torch.float32, kernel.L1_PREFETCH, 64),
        (torch.bfloat16, kernel.L1_PREFETCH, 64),
        (torch.float32, ("PF_NQ_F32=1",), 64),
        (torch.float32, ("PF_NQ_F32=1",), 128),
    ],
)
def test_prefill_tunings_change_no_output(dtype, defines, dim):
    """The prefill path computes a tile of at most 16 queries in one 16-lane half, asks for keys and values ahead
    of its reads, runs a group of tiles split by split, reads a block's keys at constant offsets and weights values
    in blocks of keys (``PF_HALF``, ``PF_PREFETCH``, ``PF_GROUP``, ``PF_CONTIG``, ``PF_PVB``); built without them all
    (``load_variant``, as ``bench_agent_attention.py`` times it) it computes the same bits: rows of 4-300 new tokens
    (one half tile, one full tile, a full and a half one, several, two groups of tiles) over scattered blocks,
    grouped-query heads, with and without a sliding window whose first key lies inside a block. Likewise fp32's
    values weighted for 6 queries at a time (3 at head dim 128) and the rest in pairs (``PF_NQ_F32``) against one
    query at a time, and the keys and values asked for into L2 against into L1 (``KV_HINT``). The float64 reference checks of the default build are the hypothesis tests above."""
    import ctypes

    lib, plain = kernel.load(), kernel.load_variant(*defines)
    if lib is None or plain is None:
        pytest.skip(f"no C kernel: {kernel.unavailable_reason()}")
    if not kernel.prefill_available(lib, dtype):
        pytest.skip(f"the prefill path is not built here for {dtype}")
    gen = torch.Generator().manual_seed(1)
    hkv, hq, bs = 2, 4, 16
    q_lens, kv_lens = [4, 12, 16, 17, 40, 80, 300], [900, 60, 1300, 17, 700, 600, 1400]
    nb = -(-max(kv_lens) // bs)
    rows = len(q_lens)
    pool = KVPool([LayerSpec((hkv, dim), (hkv, dim))], rows * nb + 8, bs, dtype=dtype, device="cpu")
    kp, vp = pool.layer(0)
    kp.normal_(generator=gen)
    vp.normal_(generator=gen)
    tables = torch.randperm(kp.shape[1], generator=gen)[: rows * nb].to(torch.int32).view(rows, nb).contiguous()
    q = torch.randn((sum(q_lens), hq, dim), generator=gen).to(dtype).float()
    q_len = torch.tensor(q_lens, dtype=torch.int32)
    q_start = (torch.cumsum(q_len, 0) - q_len).to(torch.int32)
    kv_len = torch.tensor(kv_lens, dtype=torch.int32)
    per = int(lib.paged_prefill_scratch(dim, 512)) * 2
    scratch = ctypes.create_string_buffer(per)
    for window in (0, 333):
        outs = []
        for built in (lib, plain):
            out = torch.empty((sum(q_lens), hq, dim))
            fn = built.paged_prefill_bf16 if dtype == torch.bfloat16 else built.paged_prefill_f32
            rc = fn(
                q.data_ptr(), q.stride(0), q.stride(1), kp.data_ptr(), vp.data_ptr(), kp.shape[1], bs, dim, hkv, hq,
                tables.data_ptr(), nb, q_start.data_ptr(), q_len.data_ptr(), kv_len.data_ptr(), rows, dim**-0.5,
                0.0, window, 512, out.data_ptr(), 2, scratch, per,
            )  # fmt: skip
            assert rc == 0
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        assert outs[0].isfinite().all() and outs[0].abs().sum() > 0


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    bs=st.sampled_from([1, 4, 16]),
    q_len=st.integers(1, 10),
    past=st.integers(0, 30),
    fresh_at=st.floats(0, 1),
    use_kernel=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_fresh_from_writes_recomputed_positions_to_scratch(bs, q_len, past, fresh_at, use_kernel, seed):
    """Positions below ``fresh_from`` already have their K/V in the row's blocks: what the forward makes of them
    goes to the scratch block, the rows' blocks keep their contents, and attention reads the blocks' K/V."""
    hkv, hq, dim = 2, 4, 8
    kv_len = past + q_len
    first = past
    fresh_from = first + round(fresh_at * q_len)  # first .. kv_len: some, none or all of the new tokens recomputed
    gen = torch.Generator().manual_seed(seed)
    nb = -(-kv_len // bs)
    num_blocks = nb + 3
    pool = KVPool([LayerSpec((hkv, dim), (hkv, dim))], num_blocks, bs, dtype=torch.float32, device="cpu")
    kpool, vpool = pool.layer(0)
    kpool.copy_(torch.randn(kpool.shape, generator=gen))
    vpool.copy_(torch.randn(vpool.shape, generator=gen))
    table = torch.randperm(num_blocks, generator=gen)[:nb].tolist()
    kview, vview = pool_view(kpool, bs), pool_view(vpool, bs)
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(kv_len)])
    k_true = torch.randn((hkv, kv_len, dim), generator=gen)
    v_true = torch.randn((hkv, kv_len, dim), generator=gen)
    kview[:, slots[:fresh_from]] = k_true[:, :fresh_from]  # cached: the true K/V of the positions below fresh_from
    vview[:, slots[:fresh_from]] = v_true[:, :fresh_from]
    k_new, v_new = k_true[:, first:].clone(), v_true[:, first:].clone()
    recomputed = fresh_from - first
    k_new[:, :recomputed] += 100.0  # what the forward writes for the recomputed positions: must not land
    v_new[:, :recomputed] -= 100.0
    before_k, before_v = kpool.clone(), vpool.clone()
    batch = StepBatch.make(pool, [Row(0, q_len, kv_len, table, fresh_from=fresh_from)], use_kernel=use_kernel)
    scratch = pool.scratch_block
    want_slots = [
        scratch * bs + p % bs if p < fresh_from else table[p // bs] * bs + p % bs for p in range(first, kv_len)
    ]
    assert batch.slots.tolist() == want_slots
    PagedKV(batch).update(k_new[None], v_new[None], layer_idx=0)
    for side, before, true in ((kpool, before_k, k_true), (vpool, before_v, v_true)):
        # every block but the scratch one: unchanged except the fresh positions' slots, which hold the new K/V
        view, prev = pool_view(side, bs), pool_view(before, bs)
        fresh = slots[fresh_from:]
        keep = torch.ones(num_blocks * bs, dtype=torch.bool)
        keep[fresh] = False
        assert torch.equal(view[:, : num_blocks * bs][:, keep], prev[:, : num_blocks * bs][:, keep])
        assert torch.equal(view[:, fresh], true[:, fresh_from:])
        assert torch.equal(view[:, slots], true)  # the row's blocks now hold exactly its true K/V
        if recomputed:
            assert not torch.equal(side[:, scratch], before[:, scratch])
    query = torch.randn((1, hq, q_len, dim), generator=gen)
    with use_batch(batch):
        out, _ = paged_attention(torch.nn.Identity(), query, None, None, None)
    want = reference(query[0], k_true, v_true, kv_len, 1.0 / math.sqrt(dim), None, None)
    torch.testing.assert_close(out[0].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_bf16_decoding_rows_beside_others_match_sdpa_of_their_one_query(use_kernel, monkeypatch):
    """bf16: a decoding row alone in its step is torch's SDPA of its one query bit for bit (what the bare model
    computes). Beside other rows it goes through the C kernel (``KERNEL_BF16``), which follows torch's
    flash-attention arithmetic (splits of 512 keys, bf16 probabilities) but not its order of sums nor its exp's last
    bits: outputs move by at most one bf16 ulp of the head's largest output. With the kernel off (or no compiler)
    it runs SDPA on its query twice (``TWO_QUERIES_BF16``): rarely one ulp of the output itself (here under 1%).
    Both stay within bf16 rounding of a float64 reference."""
    if use_kernel and kernel.load() is None:
        pytest.skip(f"no C kernel: {kernel.unavailable_reason()}")
    monkeypatch.setattr(att, "KERNEL_BF16", use_kernel)
    hkv, hq, dim, bs = 2, 4, 64, 16
    gen = torch.Generator().manual_seed(5)
    lens = [37, 300, 700, 1300]  # 1,300 keys: three of the kernel's softmax splits
    tables, at = [], 0
    for n in lens:
        tables.append(list(range(at, at + -(-n // bs))))
        at += -(-n // bs)
    pool = KVPool([LayerSpec((hkv, dim), (hkv, dim))], at + 1, bs, dtype=torch.bfloat16, device="cpu")
    kpool, vpool = pool.layer(0)
    kpool.copy_(torch.randn(kpool.shape, generator=gen) * 2)
    vpool.copy_(torch.randn(vpool.shape, generator=gen))
    query = torch.randn((1, hq, len(lens), dim), generator=gen).bfloat16()

    def attend(rows, q):
        batch = StepBatch.make(pool, rows, use_kernel=True)
        assert batch.kernel_rows == (list(range(len(rows))) if use_kernel and len(rows) > 1 else [])
        batch.layer = 0
        with use_batch(batch):
            return paged_attention(torch.nn.Identity(), q, None, None, None)[0][0]

    rows = [Row(i, 1, n, t) for i, (n, t) in enumerate(zip(lens, tables))]
    together = attend(rows, query)
    differ, total = 0, 0
    for i, r in enumerate(rows):
        slots = [r.blocks[p // bs] * bs + p % bs for p in range(r.kv_len)]
        k, v = pool_view(kpool, bs)[:, slots], pool_view(vpool, bs)[:, slots]
        q = query[:, :, i : i + 1]
        kk, vv = k.repeat_interleave(hq // hkv, dim=0)[None], v.repeat_interleave(hq // hkv, dim=0)[None]
        one = torch.nn.functional.scaled_dot_product_attention(q, kk, vv)[0, :, 0]  # [Hq, D]: the bare model's call
        assert torch.equal(attend([Row(0, 1, r.kv_len, r.blocks)], q)[0], one)  # alone: bit for bit
        got = together[i]
        scale = one.float().abs().amax(dim=1, keepdim=True) if use_kernel else one.float().abs()
        ulp = scale.clamp_min(2**-30) * 2**-7
        assert ((got.float() - one.float()).abs() <= ulp).all(), f"row {i}: more than one bf16 ulp off"
        differ += int((got != one).sum())
        total += one.numel()
        want = reference(q[0], k, v, r.kv_len, 1.0 / math.sqrt(dim), None, None)[0]
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    if not use_kernel:
        assert differ <= total // 100, f"{differ} of {total} outputs differ from the one-query SDPA"
