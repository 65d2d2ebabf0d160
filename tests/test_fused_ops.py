"""engine.paged.fused: RMSNorm and rotary embedding in one C pass each, against transformers' own modules and
functions (the reference): rotary bit for bit, RMSNorm to the order of a float32 sum; only known sources are
replaced; anything the kernels do not take runs the original; the model and its modeling module are left as they
were."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.paged import fused, kernel

pytestmark = pytest.mark.skipif(kernel.load_fused() is None, reason="no C compiler for the fused ops")


def _llama(dtype: torch.dtype = torch.float32, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def _llama_module():
    import transformers.models.llama.modeling_llama as ml

    return ml


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_bit_for_bit_transformers(dtype):
    ml = _llama_module()
    lib = kernel.load_fused()
    g = torch.Generator().manual_seed(3)
    # q and k as the attention makes them: [batch, tokens, heads, dim] transposed; cos and sin per batch, and shared
    q = torch.randn(2, 13, 4, 32, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(2, 13, 2, 32, generator=g).to(dtype).transpose(1, 2)
    for batch in (2, 1):
        cos = torch.randn(batch, 13, 32, generator=g).to(dtype)
        sin = torch.randn(batch, 13, 32, generator=g).to(dtype)
        want_q, want_k = ml.apply_rotary_pos_emb(q, k, cos, sin)
        got_q, got_k = fused._rotary_function(lib, ml.apply_rotary_pos_emb)(q, k, cos, sin)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    # contiguous [batch, heads, tokens, dim] inputs too
    qc, kc = q.contiguous(), k.contiguous()
    got = fused._rotary_function(lib, ml.apply_rotary_pos_emb)(qc, kc, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, ml.apply_rotary_pos_emb(qc, kc, cos, sin)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype):
    ml = _llama_module()
    norm = ml.LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1, 0.5)
    x = (torch.randn(3, 17, 96, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    want = ml.LlamaRMSNorm.forward(norm, x)
    got = fused._norm_forward(kernel.load_fused(), norm)(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:  # only the sum of squares' order differs
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:  # that order moves a bf16 output by one ulp, rarely
        diff = got != want
        assert diff.float().mean() < 0.01
        ulp = torch.finfo(torch.bfloat16).eps * want.float().abs()[diff]
        assert ((got.float() - want.float()).abs()[diff] <= ulp * 1.01).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_logits_with_fused_ops_active(dtype):
    model = _llama(dtype)
    ml = _llama_module()
    original = ml.apply_rotary_pos_emb
    ops = fused.FusedOps(model)
    assert ops.counts() == {"rms_norm": 5, "rotary_modules": 1}  # 2 layers x 2 norms + the final one
    ids = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        ref = model(input_ids=ids).logits
        with ops.active():
            assert ml.apply_rotary_pos_emb is not original
            got = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    tol = 1e-4 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    assert torch.equal(after, ref)
    assert ml.apply_rotary_pos_emb is original
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_unknown_sources_keep_their_own_code():
    ml = _llama_module()

    class ScaledNorm(ml.LlamaRMSNorm):  # another forward: not the source the kernel was checked against
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    model = _llama()
    model.model.norm = ScaledNorm(64)
    ops = fused.FusedOps(model)
    assert ops.counts()["rms_norm"] == 4 and model.model.norm not in ops.norms
    patched = model.model.layers[0].input_layernorm
    patched.forward = lambda x: x  # someone else's replacement is left alone
    assert patched not in fused.FusedOps(model).norms
    assert fused.source_hash(len) is None  # a builtin has no source: never known


def test_inputs_the_kernels_do_not_take_run_the_original():
    ml = _llama_module()
    lib = kernel.load_fused()
    norm = ml.LlamaRMSNorm(32)
    for x in (torch.randn(4, 32, dtype=torch.float16), torch.randn(32, 4).t(), torch.randn(4, 32).bfloat16()):
        # float16; a non-contiguous view; bf16 input beside a float32 weight (torch promotes: the original does)
        want = ml.LlamaRMSNorm.forward(norm, x)
        got = fused._norm_forward(lib, norm)(x)
        assert got.dtype == want.dtype and torch.equal(got, want)
    rot = fused._rotary_function(lib, ml.apply_rotary_pos_emb)
    q = torch.randn(1, 2, 5, 8)
    cos_half, sin_half = torch.randn(1, 5, 8).half(), torch.randn(1, 5, 8).half()  # mixed dtypes
    assert all(
        torch.equal(a, b)
        for a, b in zip(rot(q, q, cos_half, sin_half), ml.apply_rotary_pos_emb(q, q, cos_half, sin_half))
    )
    cos, sin = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)  # per-head cos with unsqueeze_dim=0
    want = ml.apply_rotary_pos_emb(q, q, cos[0], sin[0], unsqueeze_dim=0)
    assert all(torch.equal(a, b) for a, b in zip(rot(q, q, cos[0], sin[0], unsqueeze_dim=0), want))


def test_rotary_patch_nests_across_threads():
    """Forwards in several threads (or several engines on one family) each hold the patch; the original is back
    once the last leaves."""
    ml = _llama_module()
    original = ml.apply_rotary_pos_emb
    ops = [fused.FusedOps(_llama(layers=1)) for _ in range(2)]
    entered, leave = threading.Barrier(3), threading.Event()

    def hold(o):
        with o.active():
            entered.wait()
            leave.wait()

    threads = [threading.Thread(target=hold, args=(o,)) for o in ops]
    for t in threads:
        t.start()
    entered.wait()
    assert ml.apply_rotary_pos_emb is not original
    leave.set()
    for t in threads:
        t.join()
    assert ml.apply_rotary_pos_emb is original


def test_engine_outputs_equal_the_bare_model_with_and_without_fused_ops():
    """Greedy tokens of the engine over a shared prefix (fused ops on by default) equal the bare model's
    generate(), and the engine with ``fused_ops=False`` gives the same tokens."""
    from engine import PrefixCachedModel

    model = _llama(torch.float32, layers=2)
    prompts = [[5, 6, 7, 8] * 6 + [9 + i] for i in range(3)]
    outs = {}
    for on in (True, False):
        pcm = PrefixCachedModel(model, max_cached_tokens=512, fused_ops=on)
        engine = pcm.runtime.engine()
        assert engine is not None and (engine.fused is not None) == on
        got = pcm.generate_batch(prompts, max_new_tokens=6, do_sample=False)
        outs[on] = [got[f"req_{i}"].generated_tokens for i in range(len(prompts))]
        assert sum(got[f"req_{i}"].cached_tokens for i in range(len(prompts))) > 0  # the shared prefix hit
    with torch.inference_mode():
        bare = [
            model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p) :].tolist() for p in prompts
        ]
    assert outs[True] == bare == outs[False]
