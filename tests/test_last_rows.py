"""The last decoder layer computes only the kept rows (engine.paged.last_rows): same logits as the bare model at the
kept positions, fewer rows through its MLP and output projection, refused for code it does not know."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from engine_testutil import VOCAB, tiny_model

from engine import hf_cache
from engine.kv_pool import KVPool
from engine.paged.attention import Row
from engine.paged.last_rows import LastLayerRows
from engine.paged.runner import PagedRunner, probe_difference

BS = 4


def _runner(model: torch.nn.Module, blocks: int = 16) -> PagedRunner:
    pool = KVPool(hf_cache.probe_specs(model), blocks, BS, dtype=model.dtype, device="cpu")
    return PagedRunner(model, pool)


def _rows_seen(module: torch.nn.Module) -> tuple[list[int], object]:
    seen: list[int] = []
    # registered before the pruning's hooks, so it runs first among the forward hooks: the rows computed
    handle = module.register_forward_hook(lambda m, args, out: seen.append(out.shape[1]))
    return seen, handle


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "mistral_window", "gemma2", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_rows_match_the_bare_model(arch: str, dtype: torch.dtype) -> None:
    model = tiny_model(arch, dtype=dtype)
    runner = _runner(model)
    assert runner.last_rows is not None and runner.last_rows.reason is None
    layer = model.get_decoder().layers[-1]
    mlp_rows, h1 = _rows_seen(layer.mlp)
    o_rows, h2 = _rows_seen(layer.self_attn.o_proj)
    first_mlp_rows, h3 = _rows_seen(model.get_decoder().layers[0].mlp)
    ids = torch.randint(3, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    # two sequences in one step: 13 and 9 new tokens; logits at 3 positions of the first, the last of the second
    rows = [Row(0, 13, 13, list(range(0, 4))), Row(13, 9, 9, list(range(4, 8)))]
    flat = torch.cat([ids[0], ids[1, :9]])
    keep = torch.tensor([2, 7, 12, 21])
    got = runner.forward(runner.batch(rows), flat, keep).float()
    for h in (h1, h2, h3):
        h.remove()
    with torch.inference_mode():
        ref0 = model(input_ids=ids[:1]).logits[0].float()
        ref1 = model(input_ids=ids[1:, :9]).logits[0].float()
    want = torch.stack([ref0[2], ref0[7], ref0[12], ref1[8]])
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=0)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    assert mlp_rows == [4] and o_rows == [4]  # the last layer: the kept rows alone
    assert first_mlp_rows == [22]  # every other layer: every row
    # nothing left behind on the model
    assert not layer.mlp._forward_hooks and not layer.mlp._forward_pre_hooks
    assert not layer.self_attn.o_proj._forward_hooks and not layer.self_attn.o_proj._forward_pre_hooks


@pytest.mark.parametrize("first_keep", [[9], []])
def test_the_kv_of_pruned_rows_is_written(first_keep: list[int]) -> None:
    """The rows the last layer skips still write their keys and values: a later chunk reading them gives the bare
    model's logits. A first chunk with no logits kept (a middle chunk of a prompt) computes no row of the MLP."""
    model = tiny_model("llama")
    runner = _runner(model)
    mlp_rows, h = _rows_seen(model.get_decoder().layers[-1].mlp)
    ids = torch.randint(3, VOCAB, (1, 14), generator=torch.Generator().manual_seed(2))
    blocks = list(range(4))
    keep = torch.tensor(first_keep, dtype=torch.long)
    runner.forward(runner.batch([Row(0, 10, 10, blocks)]), ids[0, :10], keep)
    h.remove()
    assert mlp_rows == [len(first_keep)]
    got = runner.forward(runner.batch([Row(0, 4, 14, blocks)]), ids[0, 10:], torch.tensor([3])).float()
    with torch.inference_mode():
        want = model(input_ids=ids).logits[0, -1:].float()
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)


def test_every_row_kept_changes_nothing() -> None:
    model = tiny_model("llama")
    runner = _runner(model)
    mlp_rows, h = _rows_seen(model.get_decoder().layers[-1].mlp)
    ids = torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(3))
    runner.forward(runner.batch([Row(0, 6, 6, [0, 1])]), ids, torch.arange(6))
    h.remove()
    assert mlp_rows == [6]


class _OtherLayer(T.models.llama.modeling_llama.LlamaDecoderLayer):
    def forward(self, hidden_states, *args, **kwargs):  # type: ignore[no-untyped-def]
        return super().forward(hidden_states, *args, **kwargs)


def test_unknown_code_is_refused() -> None:
    """A last layer whose code is not known (another class's source, a mixture of experts, no decoder list) is left
    computing every row, with the reason."""
    gpt2 = tiny_model("gpt2")
    assert LastLayerRows(gpt2).mlp is None and LastLayerRows(gpt2).reason is not None
    llama = tiny_model("llama")
    layers = llama.get_decoder().layers
    layers[-1].__class__ = _OtherLayer
    assert LastLayerRows(llama).mlp is None and "_OtherLayer" in str(LastLayerRows(llama).reason)
    layers[-1].__class__ = T.models.llama.modeling_llama.LlamaDecoderLayer
    layers[-1].mlp.__class__ = type("OtherMLP", (torch.nn.Module,), {"forward": lambda self, x: x})
    assert "mlp" in str(LastLayerRows(llama).reason)
    llama.get_decoder().layers = torch.nn.ModuleList(list(layers)[:1])  # fewer layers than the config says
    assert LastLayerRows(llama).mlp is None and LastLayerRows(llama).reason is not None


def test_moe_last_layer_is_refused() -> None:
    cfg = T.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, head_dim=8,
    )  # fmt: skip
    model = T.Qwen3MoeForCausalLM(cfg).eval()
    rows = LastLayerRows(model)
    assert rows.mlp is None and "mlp" in str(rows.reason)


def test_probe_exercises_the_pruned_path() -> None:
    """The engine's probe takes its second chunk's logits at the last position only, so a wrong pruned layer would
    fail it: with the MLP's kept row replaced by garbage the probe sees the difference."""
    model = tiny_model("llama")
    specs = hf_cache.probe_specs(model)
    pool = KVPool(specs, 16, BS, dtype=model.dtype, device="cpu")
    assert probe_difference(model, pool, list(range(4))) < 1e-4
    mlp = model.get_decoder().layers[-1].mlp
    h = mlp.register_forward_hook(lambda m, a, out: out + 1.0 if out.shape[1] == 1 else None)
    try:
        assert probe_difference(model, pool, list(range(4))) > 1e-3
    finally:
        h.remove()


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama")
    monkeypatch.setenv("PREFIXCACHE_LAST_ROWS", "off")
    rows = LastLayerRows(model)
    assert rows.mlp is None and "PREFIXCACHE_LAST_ROWS=off" in str(rows.reason)
    runner = _runner(model)
    mlp_rows, h = _rows_seen(model.get_decoder().layers[-1].mlp)
    ids = torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(4))
    runner.forward(runner.batch([Row(0, 6, 6, [0, 1])]), ids, torch.tensor([5]))
    h.remove()
    assert mlp_rows == [6]


@pytest.mark.parametrize("preset", ["tiny-hybrid", "tiny-vlm", "tiny-swa"])
def test_presets_prune_and_stay_exact(preset: str) -> None:
    """The hybrid (Qwen3.5), image-text (Qwen2.5-VL) and sliding-window (Gemma 3) presets' last layers are known code:
    the engine computes their MLP over the kept rows only, and its greedy tokens are the bare model's."""
    from engine import PrefixCachedModel

    pcm = PrefixCachedModel.from_pretrained(preset, max_cached_tokens=2048)
    engine = pcm.engine()
    assert engine is not None and engine.runner.last_rows is not None
    assert engine.runner.last_rows.reason is None
    model = pcm.model
    mlp_rows, h = _rows_seen(model.get_decoder().layers[-1].mlp)
    g = torch.Generator().manual_seed(5)
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    prompts = [torch.randint(3, min(vocab, 250), (n,), generator=g).tolist() for n in (40, 23)]
    try:
        outs = pcm.generate_batch(prompts, max_new_tokens=6, do_sample=False)
    finally:
        h.remove()
    assert mlp_rows[0] <= len(prompts)  # the first step (the prompts) computed the MLP at its kept rows only
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            want = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p) :].tolist()
        got = outs[f"req_{i}"]
        assert got.error is None and got.generated_tokens == want


@pytest.mark.parametrize("inside", [False, True])
def test_another_threads_call_computes_every_row(inside: bool) -> None:
    """While a forward has the last layer pruned, a call of its MLP from another thread (the model used elsewhere)
    computes every row of its input, and the pruned forward still gets its kept rows back at full size: the other
    call before this thread's (``inside`` False), or while this thread's pruned call of the MLP is under way (its
    input sliced, its output not yet scattered back)."""
    import threading

    model = tiny_model("llama")
    rows = LastLayerRows(model)
    mlp = rows.mlp
    assert mlp is not None
    x = torch.randn(1, 6, 32)
    keep = torch.tensor([1, 4])
    owner = threading.get_ident()
    got: list[torch.Tensor] = []

    def other_call() -> None:
        worker = threading.Thread(target=lambda: got.append(mlp(x)))
        worker.start()
        worker.join()

    def meanwhile(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        if threading.get_ident() == owner:  # inside this thread's pruned MLP call
            other_call()

    hook = mlp.down_proj.register_forward_hook(meanwhile) if inside else None
    try:
        with torch.inference_mode(), rows.active(keep, 6):
            if not inside:
                other_call()
            mine = mlp(x)
    finally:
        if hook is not None:
            hook.remove()
    with torch.inference_mode():
        want = mlp(x)
    assert len(got) == 1
    torch.testing.assert_close(got[0], want)  # the other thread: every row
    assert mine.shape == want.shape and not mine[0, [0, 2, 3, 5]].any()  # this one: kept rows only, zeros elsewhere
    torch.testing.assert_close(mine[0, keep], want[0, keep], atol=1e-6, rtol=0)
