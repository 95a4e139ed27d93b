"""Generic HF target adapter: captures through wrappers, tree blocks + keep(), parity with native."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from eagle3.adapters import HFCache, HFTarget, load_target
from eagle3.errors import ContractError, LoadError, UnsupportedError
from eagle3.models.layers import tree_block_mask
from eagle3.models.llama import LlamaModel
from eagle3.runtime.loader import load_model

V = 128
DSV3 = dict(vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
            n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=256, initializer_range=0.2)
IDS = (2, 4, 5)   # = default_aux_layer_ids for 8 layers: 2, L//2, L-3


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_deepseek(seed: int = 0):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(DeepseekV3Config(**DSV3)).eval()


class TinyWrapperForConditionalGeneration(nn.Module):
    """Kimi-K2.5-like wrapper: a stand-in vision tower and a `.language_model` holding the LM."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.vision_tower = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        self.language_model = lm
        self.config = lm.config

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def forward(self, **kwargs):
        return self.language_model(**kwargs)


def tiny_kimi_k25(seed: int = 0):
    """transformers' own Kimi-K2.5 wrapper (model.language_model = DeepseekV3Model), tiny."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration
    vision = dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, pos_emb_time=1,
                  num_attention_heads=2, num_hidden_layers=1, hidden_size=16, intermediate_size=32)
    cfg = Kimi_K25Config(text_config=dict(model_type="deepseek_v3", **DSV3), vision_config=vision,
                         projection_hidden_size=16, image_token_id=V - 2, video_token_id=V - 1,
                         vision_start_token_id=V - 4, vision_end_token_id=V - 3,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Kimi_K25ForConditionalGeneration(cfg).eval()


def prompt(n: int = 10, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V - 4, (1, n), generator=g)   # clear of the image/video token ids


# ---------------------------------------------------------------------------- discovery + capture
@pytest.mark.parametrize("build,decoder,lm", [
    (lambda: tiny_deepseek(), "model", ""),
    (lambda: TinyWrapperForConditionalGeneration(tiny_deepseek()), "language_model.model",
     "language_model"),
    (lambda: tiny_kimi_k25(), "model.language_model", ""),
])
def test_captures_equal_output_hidden_states_through_wrappers(build, decoder, lm):
    model = build()
    target = HFTarget(model)
    assert (target.decoder_path, target.lm_path) == (decoder, lm)
    assert target.config.num_layers == 8 and target.config.attention == "mla"
    assert target.config.default_aux_layer_ids == IDS
    ids = prompt()
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True)
    out = target(ids, torch.arange(ids.shape[1]), target.new_cache(32), capture_ids=IDS)
    want = torch.cat([ref.hidden_states[i] for i in IDS], dim=-1)
    assert out.aux.shape == (1, ids.shape[1], 3 * 32)
    torch.testing.assert_close(out.aux, want, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    torch.testing.assert_close(out.hidden, ref.hidden_states[-1], rtol=0, atol=0)
    # off-by-one ids capture different tensors (the trap the convention guards against)
    assert not torch.allclose(out.aux[..., :32], ref.hidden_states[3])


def test_hooks_are_removed_after_each_call():
    target = HFTarget(TinyWrapperForConditionalGeneration(tiny_deepseek()))
    target(prompt(4), torch.arange(4), target.new_cache(8), capture_ids=IDS)
    assert all(not layer._forward_pre_hooks for layer in target.layers)
    assert not target.decoder._forward_hooks


# ---------------------------------------------------------------------------- tree block + keep
TREE = torch.tensor([[1, 0, 0, 0, 0],      # 0 root
                     [1, 1, 0, 0, 0],      # 1 child of 0
                     [1, 0, 1, 0, 0],      # 2 child of 0
                     [1, 0, 1, 1, 0],      # 3 child of 2
                     [1, 1, 0, 0, 1]], dtype=torch.bool)   # 4 child of 1
DEPTH = torch.tensor([0, 1, 1, 2, 2])


@pytest.mark.parametrize("wrap", [False, True])
def test_tree_block_then_keep_equals_cache_of_kept_tokens(wrap):
    model = tiny_deepseek()
    target = HFTarget(TinyWrapperForConditionalGeneration(model) if wrap else model)
    ids, block = prompt(9), prompt(5, seed=2)
    start = ids.shape[1]
    cache = target.new_cache(32)
    target(ids, torch.arange(start), cache)
    tree = target(block, start + DEPTH, cache, attn_mask=tree_block_mask(start, TREE),
                  capture_ids=IDS)
    kept = torch.tensor([0, 2, 3])           # the accepted path root -> 2 -> 3
    cache.keep(start, kept)
    assert cache.length == start + 3 and cache.hf.get_seq_length() == start + 3
    nxt = prompt(1, seed=3)
    after = target(nxt, torch.tensor([start + 3]), cache)

    ref_cache = target.new_cache(32)
    seq = torch.cat([ids, block[:, kept], nxt], dim=1)
    ref = target(seq, torch.arange(seq.shape[1]), ref_cache, capture_ids=IDS)
    torch.testing.assert_close(after.logits[0, -1], ref.logits[0, -1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tree.logits[0, kept], ref.logits[0, start:start + 3],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tree.aux[0, kept], ref.aux[0, start:start + 3], rtol=1e-5, atol=1e-5)
    # a wrong keep (sibling 1 instead of 2) must give different logits: the test can fail
    bad = target.new_cache(32)
    target(ids, torch.arange(start), bad)
    target(block, start + DEPTH, bad, attn_mask=tree_block_mask(start, TREE))
    bad.keep(start, torch.tensor([0, 1, 4]))
    wrong = target(nxt, torch.tensor([start + 3]), bad)
    assert not torch.allclose(wrong.logits[0, -1], ref.logits[0, -1], atol=1e-4)


def test_logits_rows_and_truncate():
    target = HFTarget(tiny_deepseek())
    ids = prompt(8)
    cache = target.new_cache(16)
    full = target(ids, torch.arange(8), cache)
    cache.truncate(5)
    assert cache.length == 5 and cache.hf.get_seq_length() == 5
    redo = target(ids[:, 5:], torch.arange(5, 8), cache, logits_rows=torch.tensor([0, 2]))
    torch.testing.assert_close(redo.logits[0], full.logits[0, [5, 7]], rtol=1e-5, atol=1e-5)
    assert target(ids[:, :1], torch.tensor([8]), cache, logits_rows=torch.tensor([],
                  dtype=torch.long)).logits is None
    assert target(ids[:, :2], torch.tensor([9, 10]), cache,
                  logits_rows=slice(-1, None)).logits.shape == (1, 1, V)


def test_cache_contract_errors():
    target = HFTarget(tiny_deepseek())
    cache = target.new_cache(4)
    with pytest.raises(Exception, match="overflow"):
        target(prompt(5), torch.arange(5), cache)
    with pytest.raises(ContractError, match="aux_layer_ids"):
        target(prompt(2), torch.arange(2), cache, capture_ids=(2, 8))
    with pytest.raises(ContractError, match="new_cache"):
        target(prompt(2), torch.arange(2), object())


def test_sliding_window_cache_is_rejected_not_approximated():
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, sliding_window=4)
    target = HFTarget(MistralForCausalLM(cfg))
    with pytest.raises(UnsupportedError, match="DynamicSlidingWindowLayer"):
        target.new_cache(16)


# ---------------------------------------------------------------------------- parity with native
def tiny_llama_dir(tmp_path, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=tie, initializer_range=0.2)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "llama", safe_serialization=True)
    return model, tmp_path / "llama"


def test_tiny_llama_through_adapter_equals_native(tmp_path):
    hf_model, path = tiny_llama_dir(tmp_path)
    native, generic = load_model(path), HFTarget(hf_model)
    assert generic.config.default_aux_layer_ids == native.config.default_aux_layer_ids
    ids = prompt(9)
    n_cache, g_cache = native.new_cache(32), generic.new_cache(32)
    a = native(ids, torch.arange(9), n_cache, capture_ids=IDS)
    b = generic(ids, torch.arange(9), g_cache, capture_ids=IDS)
    for x, y in ((a.logits, b.logits), (a.aux, b.aux), (a.hidden, b.hidden)):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    block = prompt(5, seed=4)
    mask = tree_block_mask(9, TREE)
    a = native(block, 9 + DEPTH, n_cache, attn_mask=mask, capture_ids=IDS)
    b = generic(block, 9 + DEPTH, g_cache, attn_mask=mask, capture_ids=IDS)
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a.aux, b.aux, rtol=1e-4, atol=1e-4)
    kept = torch.tensor([0, 1, 4])
    n_cache.keep(9, kept)
    g_cache.keep(9, kept)
    nxt = prompt(1, seed=5)
    a = native(nxt, torch.tensor([12]), n_cache)
    b = generic(nxt, torch.tensor([12]), g_cache)
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)


def test_load_target_picks_native_or_generic(tmp_path):
    _, llama_dir = tiny_llama_dir(tmp_path)
    assert isinstance(load_target(str(llama_dir)), LlamaModel)
    model = tiny_deepseek()
    model.save_pretrained(tmp_path / "dsv3", safe_serialization=True)
    target = load_target(str(tmp_path / "dsv3"))
    assert isinstance(target, HFTarget)
    assert isinstance(target.new_cache(8), HFCache)
    ids = prompt(6)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    torch.testing.assert_close(target(ids, torch.arange(6), target.new_cache(8)).logits, ref,
                               rtol=1e-5, atol=1e-5)


def test_load_target_refuses_pickled_weights(tmp_path):
    model = tiny_deepseek()
    model.save_pretrained(tmp_path / "dsv3", safe_serialization=True)
    (tmp_path / "dsv3" / "model.safetensors").rename(tmp_path / "dsv3" / "pytorch_model.bin")
    with pytest.raises(LoadError, match="safetensors"):
        load_target(str(tmp_path / "dsv3"))


def test_load_target_refuses_a_checkpoint_with_missing_weights(tmp_path):
    from safetensors.torch import load_file, save_file
    tiny_deepseek().save_pretrained(tmp_path / "dsv3", safe_serialization=True)
    path = tmp_path / "dsv3" / "model.safetensors"
    state = load_file(str(path))
    state.pop("model.layers.3.self_attn.kv_b_proj.weight")
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(LoadError, match="kv_b_proj"):
        load_target(str(tmp_path / "dsv3"))


@pytest.mark.real
def test_real_smollm2_through_the_adapter_matches_native(real_model):
    from transformers import AutoModelForCausalLM
    from eagle3.generate import Engine, SamplingParams
    native, tokenizer, src = real_model
    hf = AutoModelForCausalLM.from_pretrained(str(src.hf_dir), dtype=torch.float32,
                                              attn_implementation="sdpa")
    generic = HFTarget(hf)
    assert generic.config.default_aux_layer_ids == native.config.default_aux_layer_ids == (2, 15, 27)
    ids = tokenizer.encode("The capital of Italy is", add_special_tokens=False)
    a = native(torch.tensor([ids]), torch.arange(len(ids)), native.new_cache(16), capture_ids=(2, 15, 27))
    b = generic(torch.tensor([ids]), torch.arange(len(ids)), generic.new_cache(16),
                capture_ids=(2, 15, 27))
    torch.testing.assert_close(a.aux, b.aux, rtol=1e-4, atol=1e-4)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outs = [Engine(t, tokenizer, max_model_len=64).generate(prompt_ids=ids, params=params).token_ids
            for t in (native, generic)]
    assert outs[0] == outs[1]


def test_hf_target_satisfies_the_target_protocol():
    """models.target.Target: every member the engine and the decoders use, device included."""
    from eagle3.models.target import Target, TargetFacts
    target = HFTarget(tiny_deepseek())
    members = [n for n in vars(Target) if not n.startswith("_")] + ["config", "embed_tokens", "lm_head"]
    assert all(hasattr(target, n) for n in members), [n for n in members if not hasattr(target, n)]
    assert target.device == target.embed_tokens.weight.device
    facts = TargetFacts.of(target.config)
    assert (facts.num_layers, facts.architecture) == (8, "DeepseekV3ForCausalLM")
