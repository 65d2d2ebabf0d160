"""Known decoder layers run as one function each (engine.paged.lean): the same bits as transformers' own forwards
through the paged engine, hooks and unknown code left to the original forward."""

from __future__ import annotations

import functools

import pytest
import torch
from engine_testutil import VOCAB, tiny_model

from engine import hf_cache
from engine.kv_pool import KVPool
from engine.paged import lean
from engine.paged.attention import Row
from engine.paged.runner import PagedRunner

BS = 4


def _runner(model: torch.nn.Module) -> PagedRunner:
    pool = KVPool(hf_cache.probe_specs(model), 16, BS, dtype=model.dtype, device="cpu")
    return PagedRunner(model, pool)


def _steps(runner: PagedRunner, ids: torch.Tensor) -> list[torch.Tensor]:
    """Two prompts prefilled in one step, then three steps decoding both: each step's logits."""
    a, b = list(range(0, 4)), list(range(4, 8))
    flat = torch.cat([ids[0, :9], ids[1, :6]])
    out = [runner.forward(runner.batch([Row(0, 9, 9, a), Row(9, 6, 6, b)]), flat, torch.tensor([8, 14]))]
    for t in range(3):
        rows = [Row(0, 1, 10 + t, a), Row(1, 1, 7 + t, b)]
        step = torch.stack([ids[0, 9 + t], ids[1, 6 + t]])
        out.append(runner.forward(runner.batch(rows), step, torch.tensor([0, 1])))
    return out


def _counting(monkeypatch: pytest.MonkeyPatch, cls: type, calls: list[torch.nn.Module]) -> None:
    original = cls.forward

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", forward)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral_window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_layers_give_transformers_bits(monkeypatch: pytest.MonkeyPatch, arch: str, dtype: torch.dtype) -> None:
    model = tiny_model(arch, dtype=dtype)
    layers = model.get_decoder().layers
    lean_runner = _runner(model)
    assert lean_runner.lean.layers == list(layers) and not lean_runner.lean.reasons
    monkeypatch.setenv(lean.ENV, "off")
    plain_runner = _runner(model)
    assert plain_runner.lean.layers == []
    calls: list[torch.nn.Module] = []
    _counting(monkeypatch, type(layers[0].mlp), calls)  # after both runners read the (known) source
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    got = _steps(lean_runner, ids)
    # the first layer ran lean (its MLP module never called); the last one ran transformers' forward, because the
    # last layer's row pruning hooks its MLP
    assert layers[0].mlp not in calls and layers[-1].mlp in calls
    calls.clear()
    want = _steps(plain_runner, ids)
    assert layers[0].mlp in calls
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert all("forward" not in m.__dict__ for m in layers)  # the model as it was


def test_a_hooked_submodule_runs_the_original_forward() -> None:
    model = tiny_model("llama")
    runner = _runner(model)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    want = _steps(runner, ids)
    hooked = _runner(model)
    seen: list[int] = []
    handle = (
        model.get_decoder()
        .layers[0]
        .self_attn.q_proj.register_forward_hook(lambda m, args, out: seen.append(out.shape[1]))
    )
    try:
        got = _steps(hooked, ids)
    finally:
        handle.remove()
    assert seen == [15, 2, 2, 2]  # the hook saw every forward
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_with_gradients_the_mlp_does_not_work_in_place() -> None:
    """Outside inference mode, with gradients, the lean forward computes what the model does and backpropagates
    (SiLU in place would break autograd)."""
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    want = model(input_ids=ids).logits
    layers = lean.LeanLayers(model)
    assert len(layers.layers) == 2
    with layers.active():
        assert all("forward" in m.__dict__ for m in layers.layers)
        got = model(input_ids=ids).logits
    got.sum().backward()
    assert torch.equal(got, want)
    assert model.get_decoder().layers[0].mlp.gate_proj.weight.grad is not None


@pytest.mark.parametrize(
    ("arch", "why"),
    [
        ("phi3", "Phi3DecoderLayer.forward is not known code"),
        ("gemma2", "Gemma2DecoderLayer.forward is not known code"),
        ("llama", "OtherAttention.forward is not known code"),  # Llama's layer and MLP, an attention of other code
    ],
)
def test_unknown_code_keeps_its_forward(arch: str, why: str) -> None:
    model = tiny_model(arch)
    if arch == "llama":
        attn_cls = type(model.get_decoder().layers[0].self_attn)

        class OtherAttention(attn_cls):  # type: ignore[misc, valid-type]
            def forward(self, *args, **kwargs):
                return super().forward(*args, **kwargs)

        for layer in model.get_decoder().layers:
            layer.self_attn.__class__ = OtherAttention
    layers = lean.LeanLayers(model)
    assert layers.layers == []
    assert why in layers.reasons.values()


def test_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(lean.ENV, "off")
    model = tiny_model("llama")
    layers = lean.LeanLayers(model)
    assert layers.layers == [] and layers.reasons == {}
    with layers.active():
        assert all("forward" not in m.__dict__ for m in model.get_decoder().layers)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral_window"])
def test_the_attention_function_gets_what_transformers_passes(monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """The attention function (and the cache's update) see the same arguments from the lean forward as from
    transformers' (position_ids and use_cache among them, and the sliding window where the attention passes one:
    an attention implementation may read them)."""
    from transformers import AttentionInterface

    from engine.paged.attention import ATTENTION_NAME

    model = tiny_model(arch)
    lean_runner = _runner(model)
    monkeypatch.setenv(lean.ENV, "off")
    plain_runner = _runner(model)
    original = AttentionInterface._global_mapping[ATTENTION_NAME]
    seen: list[tuple] = []

    def recording(module, q, k, v, mask, **kwargs):
        seen.append((module.layer_idx, q.shape, k.shape, mask, sorted(kwargs.items(), key=lambda kv: kv[0])))
        return original(module, q, k, v, mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, ATTENTION_NAME, recording)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    _steps(lean_runner, ids)
    got, seen[:] = list(seen), []
    _steps(plain_runner, ids)

    def comparable(calls: list[tuple]) -> list[tuple]:
        return [
            (i, qs, ks, m, [(n, v.tolist() if isinstance(v, torch.Tensor) else v) for n, v in kw])
            for i, qs, ks, m, kw in calls
        ]

    assert len(got) == 8 and comparable(got) == comparable(seen)
    assert all("position_ids" in dict(kw) and "use_cache" in dict(kw) for *_, kw in got)
    windows = {dict(kw).get("sliding_window", "none") for *_, kw in got}
    assert windows == {"llama": {"none"}, "qwen2": {None}, "mistral_window": {6}}[arch]


def test_a_replaced_submodule_is_the_one_that_runs() -> None:
    """A projection replaced after the engine was made (as a LoRA adapter's layer replaces one) is the one the
    forward computes with: the lean forward, made for the old one, leaves the call to transformers' forward."""
    model = tiny_model("llama")
    runner = _runner(model)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    before = _steps(runner, ids)
    attn = model.get_decoder().layers[0].self_attn
    new = torch.nn.Linear(attn.q_proj.in_features, attn.q_proj.out_features, bias=False)
    with torch.no_grad():
        new.weight.copy_(attn.q_proj.weight * 1.5)
    attn.q_proj = new
    got = _steps(_runner(model), ids)  # a fresh pool; the old runner's lean forwards hold the old projection
    want = _steps(runner, ids)
    for g, w, b in zip(got, want, before):
        assert torch.equal(w, g)
        assert not torch.equal(w, b)  # the new projection changed the logits
