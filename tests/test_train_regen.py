import pytest
import torch

from eagle3.sampling import SamplingParams, sample_rows, target_probs
from eagle3.models.config import ModelConfig
from eagle3.models.llama import LlamaModel
from eagle3.models.kv_cache import KVCache
from eagle3.train.regen import generate_batch, pick_tokens

EOS, TRIGGER, LEAD = 3, 7, 6


def tiny_target(seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                               "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "max_position_embeddings": 128,
                               "eos_token_id": 3})
    model = LlamaModel(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def test_left_padded_batch_equals_each_sequence_alone():
    model = tiny_target()
    prompts = [[5, 9, 12, 7, 30, 31, 2], [8, 1], [40, 41, 42, 43], [17]]
    gen = torch.Generator().manual_seed(0)
    batched = generate_batch(model, prompts, [0.0] * 4, 12, [3], 0, gen)
    for b, p in enumerate(prompts):
        alone = generate_batch(model, [p], [0.0], 12, [3], 0, gen)
        assert alone.tokens[0] == batched.tokens[b]
        assert alone.finished[0] == batched.finished[b]
    assert len({tuple(t) for t in batched.tokens}) > 1       # not a degenerate constant output


def eos_target(seed: int = 1) -> LlamaModel:
    """tiny_target whose next token is EOS right after TRIGGER, TRIGGER right after LEAD, and
    neither otherwise, by construction: hidden dims 0, 1, 2 carry "the current token is TRIGGER",
    a constant and "is LEAD" straight from the embedding (no layer writes them), and only the EOS
    and TRIGGER rows of lm_head read them, with margins of ~1000 logits. The layers stay random."""
    model = tiny_target(seed)
    with torch.no_grad():
        emb, head = model.embed_tokens.weight, model.lm_head.weight
        emb[:, :3] = 0.0
        emb[:, 1] = 1.0
        emb[TRIGGER, 0] = emb[LEAD, 2] = 100.0
        for layer in model.layers:
            layer.self_attn.o_proj.weight[:3] = 0.0
            layer.mlp.down_proj.weight[:3] = 0.0
        model.norm.weight[:3] = 1.0
        head[:, :3] = 0.0
        head[EOS] = head[TRIGGER] = 0.0
        head[EOS, :2] = torch.tensor([1000.0, -1000.0])
        head[TRIGGER, 1:3] = torch.tensor([-1000.0, 1000.0])
    return model


def test_rows_leave_batch_at_eos():
    model = eos_target()
    prompts = [[5, 9, TRIGGER], [8, 1, 4, 4, 4], [40, LEAD], [17], [12, 13]]
    temps = [0.0, 0.0, 1.0, 1.0, 0.0]
    out = generate_batch(model, prompts, temps, 20, [EOS], 0, torch.Generator().manual_seed(0))
    # rows 0 and 2 leave the batch after steps 0 and 1; the others run to max_new_tokens
    assert out.finished == [True, False, True, False, False]
    assert out.tokens[0] == [EOS] and out.tokens[2] == [TRIGGER, EOS]
    assert [len(t) for t in out.tokens] == [1, 20, 2, 20, 20]
    for toks, fin in zip(out.tokens, out.finished):
        assert fin == (toks[-1] == EOS)
        assert EOS not in toks[:-1]
    for b in (1, 4):          # greedy rows that stayed: as if generated alone (the cache kept them)
        alone = generate_batch(model, [prompts[b]], [0.0], 20, [EOS], 0, torch.Generator())
        assert alone.tokens[0] == out.tokens[b]


# ---------------------------------------------------------------------------- shared sampler, cache
def test_regen_draws_through_the_shared_sampler():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 50, generator=gen) * 2
    temps = torch.tensor([0.0, 1.0, 0.7, 1.3] * 16)
    picked = pick_tokens(logits, temps, torch.Generator().manual_seed(7))
    hot = temps > 0
    probs = torch.stack([target_probs(logits[r], SamplingParams(temperature=float(temps[r])))
                         for r in hot.nonzero()[:, 0].tolist()])
    assert torch.equal(picked[hot], sample_rows(probs, torch.Generator().manual_seed(7)))
    assert torch.equal(picked[~hot], logits[~hot].argmax(-1))


def test_kv_cache_take_rows_keeps_the_live_slots_of_those_rows():
    cache = KVCache(2, 2, 4, 10, batch=3)
    cache.k.normal_(generator=torch.Generator().manual_seed(0))
    cache.v.normal_(generator=torch.Generator().manual_seed(1))
    cache.advance(6)
    rows = torch.tensor([2, 0])
    part = cache.take_rows(rows)
    assert (part.batch, part.length, part.max_len) == (2, 6, 10)
    assert part.k.dtype == cache.k.dtype and part.k.device == cache.k.device
    assert torch.equal(part.k[:, :, :, :6], cache.k[:, rows, :, :6])
    assert torch.equal(part.v[:, :, :, :6], cache.v[:, rows, :, :6])
    part.advance(4)                                  # room as the original had it
    with pytest.raises(Exception, match="overflow"):
        part.advance(1)


def test_every_cache_regen_runs_on_comes_from_the_constructor(monkeypatch):
    model = eos_target()
    built, used = set(), []
    init = KVCache.__init__

    def counting_init(self, *args, **kwargs):
        built.add(id(self))
        init(self, *args, **kwargs)

    monkeypatch.setattr(KVCache, "__init__", counting_init)
    forward = model.forward
    model.forward = lambda ids, pos, cache, **kw: used.append(cache) or forward(ids, pos, cache, **kw)
    out = generate_batch(model, [[5, TRIGGER], [8, 1], [40, LEAD]], [0.0] * 3, 6, [EOS], 0,
                         torch.Generator())
    assert out.finished == [True, False, True]
    assert len({id(c) for c in used}) == 3            # the first cache and two shrunk ones
    assert all(id(c) in built for c in used)
