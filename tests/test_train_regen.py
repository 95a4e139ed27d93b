import torch

from eagle3.models.config import ModelConfig
from eagle3.models.llama import LlamaModel
from eagle3.train.regen import generate_batch


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


def test_rows_leave_batch_at_eos():
    model = tiny_target(1)
    prompts = [[5, 9, 12], [8, 1, 4, 4, 4], [40]]
    gen = torch.Generator().manual_seed(0)
    # make token 3 (eos) the argmax after token 12 only, by construction of the lm_head bias-free
    out = generate_batch(model, prompts, [0.0] * 3, 20, list(range(64))[:1] + [3], 0, gen)
    for toks, fin in zip(out.tokens, out.finished):
        assert fin == (toks[-1] in (0, 3))
        assert all(t not in (0, 3) for t in toks[:-1])
