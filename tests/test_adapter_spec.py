"""The incident rebuilt small: a tiny DeepseekV3 (MoE, MLA) inside a wrapper, an EAGLE-3 draft
reading 3 x hidden, speculation through the generic adapter."""
from __future__ import annotations

import pytest
import torch

from eagle3.adapters import HFTarget
from eagle3.errors import ContractError
from eagle3.generate import Engine, SamplingParams
from eagle3.draft.model import DraftConfig, Eagle3Draft
from eagle3.speculative.tree import SpecParams

from test_adapter import IDS, TinyWrapperForConditionalGeneration, prompt, tiny_deepseek, tiny_kimi_k25


class StubTokenizer:
    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


class CopyDraft(Eagle3Draft):
    """A real Eagle3Draft (cache, feature-width contract) that proposes a known continuation.

    `seq[p]` is the token at position p; a row at position j whose input id is seq[j+1] ranks
    seq[j+2] first, except every third row where a wrong token ranks first (so chains miss and
    trees recover).
    """

    def __init__(self, cfg: DraftConfig, seq: list[int]):
        super().__init__(cfg)
        self.seq = torch.tensor(seq + [0, 0])

    def forward(self, input_ids, positions, cache, **kw):
        rows = kw.pop("logits_rows", None)
        out = super().forward(input_ids, positions, cache, **kw)
        pos = (positions if positions.dim() == 2 else positions[None]).clamp(max=len(self.seq) - 3)
        on_track = (self.seq[pos + 1] == input_ids).float()[..., None]
        logits = 0.01 * self.head(out.hidden)
        logits.scatter_add_(-1, self.seq[pos + 2][..., None], on_track * 10.0)
        noisy = on_track * ((pos * 7) % 3 == 0).float()[..., None]
        logits.scatter_add_(-1, ((self.seq[pos + 2] + 1) % logits.shape[-1])[..., None], noisy * 12.0)
        return type(out)(logits if rows is None else logits[:, rows], out.hidden)


def eagle3_draft_for(target: HFTarget, seq=None, seed: int = 3) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = DraftConfig.for_target(target.config, aux_layer_ids=IDS)
    draft = CopyDraft(cfg, seq) if seq is not None else Eagle3Draft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" not in name and "embed" not in name:
                p.normal_(0.0, 0.3)
    draft.set_embedding(target.embed_tokens.weight)
    return draft.eval()


def generate(target, draft=None, spec=None, ids=None, max_new: int = 20) -> tuple[list[int], float]:
    engine = Engine(target, StubTokenizer(), draft=draft, spec=spec, max_model_len=64)
    out = engine.generate(prompt_ids=ids, params=SamplingParams(max_new_tokens=max_new,
                                                                ignore_eos=True))
    return out.token_ids, out.tau


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def wrapped_target() -> HFTarget:
    return HFTarget(TinyWrapperForConditionalGeneration(tiny_deepseek(seed=5)))


def test_draft_expects_three_times_target_hidden(wrapped_target):
    draft = eagle3_draft_for(wrapped_target)
    assert draft.fc.in_features == 3 * wrapped_target.config.hidden_size == 96


@pytest.mark.parametrize("spec", [SpecParams.chain(3), SpecParams(top_k=2, depth=3, num_draft_tokens=6),
                                  SpecParams(top_k=3, depth=4, num_draft_tokens=9)],
                         ids=["chain3", "k2d3n6", "k3d4n9"])
def test_greedy_speculation_through_adapter_is_lossless(wrapped_target, spec):
    ids = prompt(7, seed=11)[0].tolist()
    plain, _ = generate(wrapped_target, ids=ids)
    random_out, random_tau = generate(wrapped_target, eagle3_draft_for(wrapped_target), spec, ids)
    assert random_out == plain
    copy_out, copy_tau = generate(wrapped_target, eagle3_draft_for(wrapped_target, ids + plain),
                                  spec, ids)
    assert copy_out == plain
    assert copy_tau > 1.5 > random_tau - 0.5   # tokens really were accepted through the adapter


def test_speculation_through_transformers_kimi_wrapper_is_lossless():
    target = HFTarget(tiny_kimi_k25(seed=2))
    ids = prompt(6, seed=12)[0].tolist()
    plain, _ = generate(target, ids=ids, max_new=12)
    out, tau = generate(target, eagle3_draft_for(target, ids + plain),
                        SpecParams(top_k=2, depth=3, num_draft_tokens=6), ids, max_new=12)
    assert out == plain and tau > 1.5


def test_eagle3_draft_fed_one_hidden_state_is_an_error_naming_eagle3(wrapped_target):
    """What SGLang's EAGLE setting does to an EAGLE-3 draft: one Ht-wide state instead of 3 x Ht."""
    draft = eagle3_draft_for(wrapped_target)
    ids = prompt(5)
    out = wrapped_target(ids, torch.arange(5), wrapped_target.new_cache(16), capture_ids=IDS)
    with torch.inference_mode():
        draft(ids, torch.arange(5), draft.new_cache(16), features=out.aux)     # 3 x Ht: fine
        with pytest.raises(ContractError, match="EAGLE3") as err:
            draft(ids, torch.arange(5), draft.new_cache(16), features=out.hidden)   # EAGLE: Ht
    assert "96" in str(err.value) and "32" in str(err.value)


def test_saved_draft_for_wrapped_deepseek_loads_and_refuses_algorithm_eagle(wrapped_target,
                                                                           tmp_path):
    from eagle3.draft.formats import load_draft, save_draft
    draft_dir = save_draft(eagle3_draft_for(wrapped_target), tmp_path / "d", "specforge",
                           wrapped_target.config)
    loaded = load_draft(draft_dir, wrapped_target.config, target=wrapped_target)
    assert loaded.info.aux_layer_ids == IDS and loaded.draft.fc.in_features == 96
    ids = prompt(6, seed=13)[0].tolist()
    plain, _ = generate(wrapped_target, ids=ids, max_new=10)
    assert generate(wrapped_target, loaded.draft, SpecParams.chain(3), ids, max_new=10)[0] == plain
    with pytest.raises(ContractError, match="EAGLE3") as err:
        load_draft(draft_dir, wrapped_target.config, algorithm="eagle")
    assert "--speculative-algorithm EAGLE3" in err.value.fix


def test_doctor_on_the_wrapped_deepseek_pair_flags_the_incident_line(wrapped_target, tmp_path):
    from eagle3.doctor import run_doctor
    from eagle3.draft.formats import save_draft
    draft_dir = save_draft(eagle3_draft_for(wrapped_target), tmp_path / "d", "specforge",
                           wrapped_target.config)
    line = (f"python -m sglang.launch_server --model-path moonshotai/Kimi-K2.5 --speculative-algorithm"
            f" EAGLE --speculative-draft-model-path {draft_dir} --speculative-num-steps 3 "
            "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4")
    report = run_doctor(wrapped_target, draft_dir, line, probe=False)
    assert "generic HF adapter" in report.checks[0].message
    failures = {c.name for c in report.failures}
    assert failures == {"launch.sglang.algorithm"}, report.table()
