"""PrefixCachedModel.generate with one namespace per batch row (a server batch mixes tenants)."""

from __future__ import annotations

import pytest
import torch
from engine_testutil import BS, expected_cached, left_pad, rand_tokens, tiny_model

from engine import PrefixCachedModel


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_rows_of_different_namespaces_never_share(llama):
    pcm = PrefixCachedModel(llama, max_cached_tokens=4096, block_size=BS)
    g = torch.Generator().manual_seed(21)
    a, b = rand_tokens(g, 18), rand_tokens(g, 11)
    committed: dict[str, list[list[int]]] = {"x": [], "y": []}

    def run(rows: list[list[int]], spaces: list[str]) -> None:
        ids, mask = left_pad(rows)
        ref = llama.generate(ids, attention_mask=mask, max_new_tokens=4)
        out = pcm.generate(ids, attention_mask=mask, max_new_tokens=4, namespace=spaces)
        assert torch.equal(out, ref)
        want = [expected_cached(r, committed[ns]) for r, ns in zip(rows, spaces)]
        assert [s.cached_tokens for s in pcm.last_request_stats] == want
        for i, ns in enumerate(spaces):  # no eos in these models: every row keeps all its tokens
            committed[ns].append(out[i, ids.shape[1] - len(rows[i]) : -1].tolist())
        pcm.cache.check_integrity()
        assert pcm.cache.num_active_requests == 0

    run([a], ["x"])
    # the same prompt in two namespaces of one batch: only x's row hits
    run([a + b[:3], a + b[:3]], ["x", "y"])
    run([a + b, b, a], ["y", "x", "x"])
    # a tuple of namespaces is accepted too; the plain-str form still applies to every row
    ids, mask = left_pad([b, a])
    pcm.generate(ids, attention_mask=mask, max_new_tokens=1, namespace=("y", "x"))
    assert [s.cached_tokens for s in pcm.last_request_stats] == [
        expected_cached(b, committed["y"]),
        expected_cached(a, committed["x"]),
    ]


def test_bad_namespace_lists_raise_and_leave_no_pin(llama):
    pcm = PrefixCachedModel(llama, max_cached_tokens=1024, block_size=BS)
    ids, mask = left_pad([[5, 6, 7, 8, 9], [7, 8, 9]])
    with pytest.raises(ValueError, match="2 batch rows"):
        pcm.generate(ids, attention_mask=mask, max_new_tokens=1, namespace=["a"])
    with pytest.raises(TypeError, match=r"namespace\[1\]"):
        pcm.generate(ids, attention_mask=mask, max_new_tokens=1, namespace=["a", 3])
    with pytest.raises(TypeError, match="namespace must be"):
        pcm.generate(ids, attention_mask=mask, max_new_tokens=1, namespace=7)
    pcm.cache.check_integrity()
    assert pcm.cache.num_active_requests == 0
