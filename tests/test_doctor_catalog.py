"""The catalog of silent failures (eagle3/doctor/catalog.py): the table, its generated doc, and each
row rebuilt small (a broken draft directory, launch line or recorded server response) where the
doctor names the field, both values and the fix, while the good case passes."""
from __future__ import annotations

import json
import urllib.request
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.doctor import doctor_main, lint_launch, run_doctor, run_server_doctor
from eagle3.doctor.catalog import BY_ID, CATALOG, catalog_id, listing, markdown
from eagle3.doctor.endpoint import Counters, ServerInfo
from eagle3.doctor.server import LiveStats, PhaseResult, PHASES, ServerSettings, argmax_check
from eagle3.draft import template
from eagle3.engines import LIVE_VLLM
from eagle3.serve import create_app
from eagle3.speculative.monitor import DraftWatch
from eagle3.speculative.step import Step
from serve_fixtures import GroupedDecoder, GroupedEngine, RunningServer, tiny_target, tokenizer
from test_doctor import (IDS, PROBE, by_name, copy_draft, save_target, bigram_target,  # noqa: F401
                         sglang, target, target_dir, vllm, write_draft)
from test_doctor_server import FakeEngine, run_fake

ROOT = Path(__file__).resolve().parents[1]
KEY = "k"
FAST = ServerSettings(max_tokens=12, timeout_s=30)

pytestmark = pytest.mark.usefixtures("one_thread")


def only(checks, name: str):
    found = [c for c in checks if c.name == name]
    assert len(found) == 1, f"{name}: {[(c.name, c.status) for c in checks]}"
    return found[0]


def names_field(check, field: str, *values) -> None:
    """A finding that names the field, both values and a fix."""
    assert check.field == field and check.fix, check
    for v in values:
        assert str(v) in check.message, (v, check.message)


def as_json(report) -> dict[str, dict]:
    return {c["name"]: c for c in json.loads(report.to_json())["checks"]}


# ---------------------------------------------------------------------------- the table itself
def test_the_doc_is_generated_from_the_catalog():
    doc = (ROOT / "docs" / "silent-failures.md").read_text()
    assert doc == markdown(), "regenerate docs/silent-failures.md (command in its header)"


def test_every_row_has_its_test_a_source_and_a_severity():
    here = globals()
    for row in CATALOG:
        assert callable(here.get(row.test)), f"{row.id}: no test {row.test} in this module"
        assert row.source and row.severity in ("error", "warning") and row.checks
    assert len(BY_ID) == len(CATALOG)


def test_list_checks_prints_every_row(capsys):
    assert doctor_main(["--list-checks"]) == 0
    out = capsys.readouterr().out
    assert out == listing() and all(f.id in out and f.source in out for f in CATALOG)


def test_strict_fails_on_warnings_and_json_carries_the_catalog_id(tmp_path, target_dir, target,
                                                                  capsys):
    draft_dir = write_draft(tmp_path, copy_draft(target), "d", target=target)
    line = "SGLANG_ENABLE_SPEC_V2=1 " + sglang(target_dir, draft_dir)       # a warning only
    argv = ["--target", str(target_dir), "--draft", str(draft_dir), "--no-probe", "--launch", line]
    assert doctor_main(argv + ["--json"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["launch.sglang.overlap_schedule"]["status"] == "warn"
    assert checks["launch.sglang.overlap_schedule"]["catalog"] == "sglang-overlap-eagle3"
    assert checks["launch.sglang.algorithm"]["catalog"] == "eagle-vs-eagle3"
    assert doctor_main(argv + ["--strict"]) == 1
    assert "known failure: sglang-overlap-eagle3" in capsys.readouterr().out
    clean = ["--target", str(target_dir), "--draft", str(draft_dir), "--no-probe", "--launch",
             sglang(target_dir, draft_dir), "--strict"]
    assert doctor_main(clean) == 0, capsys.readouterr().out


# ---------------------------------------------------------------------------- pair checks
def reduced_draft(target, draft_vocab: int = 32, from_target: bool = True):
    """A draft over `draft_vocab` of the target's tokens whose lm_head started as the target's rows of
    those tokens (as `eagle3 train` starts it), a little trained since."""
    draft = copy_draft(target, draft_vocab=draft_vocab)
    vocab = target.config.vocab_size
    used = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))[:draft_vocab].sort().values
    with torch.no_grad():
        draft.d2t.copy_(used - torch.arange(draft_vocab))
        draft.t2d.zero_()
        draft.t2d[used] = True
        if from_target:
            rows = target.lm_head.weight[used]
            draft.lm_head.weight.copy_(rows + 0.05 * rows.std() * torch.randn_like(rows))
    return draft


def test_d2t_missing(tmp_path, target_dir, target):
    good = write_draft(tmp_path, reduced_draft(target), "good", target=target)
    report = run_doctor(str(target_dir), good, probe=False)
    assert not [c for c in report.checks if c.name == "draft.d2t"] and report.ok, report.table()
    broken = write_draft(tmp_path, reduced_draft(target), "broken", target=target)
    state = load_file(str(broken / "model.safetensors"))
    save_file({k: v for k, v in state.items() if k not in ("d2t", "t2d")}, str(broken / "model.safetensors"))
    report = run_doctor(str(target_dir), broken, probe=False)
    check = only(report.checks, "draft.d2t")
    assert check.status == "fail" and report.exit_code == 1
    names_field(check, "d2t", "absent", "draft_vocab_size 32 < vocab_size 64")
    assert "first 32 target ids" in check.message and "d2t" in check.fix
    assert as_json(report)["draft.d2t"]["catalog"] == "d2t-missing"


def test_d2t_permuted(tmp_path, target_dir, target):
    draft = reduced_draft(target)
    report = run_doctor(str(target_dir), write_draft(tmp_path, draft, "good", target=target), probe=False)
    assert only(report.checks, "contract.d2t_rows").status == "pass" and report.ok, report.table()
    targets = torch.arange(32) + draft.d2t
    shuffled = targets[torch.randperm(32, generator=torch.Generator().manual_seed(5))]
    with torch.no_grad():
        draft.d2t.copy_(shuffled - torch.arange(32))          # rebuilt: same tokens, other order
    report = run_doctor(str(target_dir), write_draft(tmp_path, draft, "bad", target=target), probe=False)
    check = only(report.checks, "contract.d2t_rows")
    assert check.status == "fail" and report.exit_code == 1, report.table()
    names_field(check, "d2t (lm_head rows vs mapped target rows)", ">= 90%")
    assert "rows at their own token" in check.message and "restore the d2t" in check.fix
    assert as_json(report)["contract.d2t_rows"]["catalog"] == "d2t-rebuilt"
    # a draft whose lm_head never was the target's rows: nothing to judge from the weights
    other = reduced_draft(target, from_target=False)
    report = run_doctor(str(target_dir), write_draft(tmp_path, other, "scratch", target=target),
                        probe=False)
    assert only(report.checks, "contract.d2t_rows").status == "pass"


def test_draft_context(tmp_path, target_dir, target):
    draft_dir = write_draft(tmp_path, copy_draft(target), "d", target=target)   # window 128
    checks = lint_launch(sglang(target_dir, draft_dir, extra="--context-length 4096"))
    check = only(checks, "launch.sglang.context_length")
    assert check.status == "fail"
    names_field(check, "max_position_embeddings (draft)", 128, ">= 4096")
    assert "--context-length 128" in check.fix
    check = only(lint_launch(vllm(target_dir, draft_dir).replace("128", "8192")),
                 "launch.vllm.context_length")
    assert check.status == "fail" and "--max-model-len 128" in check.fix
    assert only(lint_launch(sglang(target_dir, draft_dir, extra="--context-length 128")),
                "launch.sglang.context_length").status == "pass"
    assert only(lint_launch(sglang(target_dir, draft_dir)),           # the target's own 128
                "launch.sglang.context_length").status == "pass"
    # the pair check: a draft window shorter than the target's (a warning in our engine, which
    # refuses positions past it) carries the same row
    short = write_draft(tmp_path, copy_draft(target), "short", target=target,
                        edit=lambda c: c.update(max_position_embeddings=64))
    report = run_doctor(str(target_dir), short, probe=False)
    row = [c for c in as_json(report).values() if c["catalog"] == "draft-context"]
    assert row and row[0]["status"] == "warn" and "64" in row[0]["message"]


# ---------------------------------------------------------------------------- launch lint
def vllm_line(target_dir, draft_dir, **spec) -> str:
    conf = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": 3, **spec}
    return f"vllm serve {target_dir} --speculative-config '{json.dumps(conf)}'"


def test_vllm_disable_by_batch_size(tmp_path, target_dir, target):
    draft_dir = write_draft(tmp_path, copy_draft(target), "d", target=target)
    line = vllm_line(target_dir, draft_dir, disable_by_batch_size=8)
    for versions in (None, {"vllm": "0.10.0"}, {"vllm": "0.32.0"}):
        check = only(lint_launch(line, versions=versions), "launch.vllm.disable_by_batch_size")
        assert check.status == "fail", versions
        names_field(check, "speculative_config.disable_by_batch_size", 8, "unset on vLLM >= 0.10")
        assert "num_speculative_tokens_per_batch_size" in check.fix
    assert only(lint_launch(line, versions={"vllm": "0.9.2"}),
                "launch.vllm.disable_by_batch_size").status == "pass"     # V0 reads it
    old_flag = f"{vllm_line(target_dir, draft_dir)} --speculative-disable-by-batch-size 4"
    assert only(lint_launch(old_flag), "launch.vllm.disable_by_batch_size").status == "fail"
    assert not [c for c in lint_launch(vllm_line(target_dir, draft_dir))
                if c.name == "launch.vllm.disable_by_batch_size"]


def test_vllm_draft_max_model_len(tmp_path, target_dir, target):
    draft_dir = write_draft(tmp_path, copy_draft(target), "d", target=target)
    line = vllm_line(target_dir, draft_dir, max_model_len=100)
    check = only(lint_launch(line, versions={"vllm": "0.26.0"}), "launch.vllm.draft_max_model_len")
    assert check.status == "fail"
    names_field(check, "speculative_config.max_model_len", 100, "unset on the V1 engine")
    assert only(lint_launch(line, versions={"vllm": "0.8.5"}),
                "launch.vllm.draft_max_model_len").status == "pass"
    assert not [c for c in lint_launch(vllm_line(target_dir, draft_dir))
                if c.name == "launch.vllm.draft_max_model_len"]


def test_sglang_token_map(tmp_path, target_dir, target):
    draft_dir = write_draft(tmp_path, copy_draft(target), "d", target=target)
    line = sglang(target_dir, draft_dir) + " --speculative-token-map thor/hot_token_ids.pt"
    check = only(lint_launch(line), "launch.sglang.token_map")
    assert check.status == "fail"
    names_field(check, "--speculative-token-map", "thor/hot_token_ids.pt", "unset with "
                "--speculative-algorithm EAGLE3")
    assert "drop the flag" in check.fix
    eagle2 = sglang(target_dir, draft_dir, algo="EAGLE") + " --speculative-token-map t.pt"
    assert only(lint_launch(eagle2), "launch.sglang.token_map").status == "pass"
    assert not [c for c in lint_launch(sglang(target_dir, draft_dir)) if c.name.endswith("token_map")]


def test_no_draft_path(tmp_path, target_dir, target):
    draft_dir = write_draft(tmp_path, copy_draft(target), "d", target=target)
    no_path = sglang(target_dir, draft_dir).replace(f"--speculative-draft-model-path {draft_dir}", "")
    check = only(lint_launch(no_path), "launch.sglang.draft_path")
    assert check.status == "fail" and "--speculative-draft-model-path" in check.fix
    no_model = f"vllm serve {target_dir} --speculative-config " \
               "'{\"method\": \"eagle3\", \"num_speculative_tokens\": 3}'"
    check = only(lint_launch(no_model), "launch.vllm.draft_path")
    assert check.status == "fail" and "\"model\"" in check.fix
    assert catalog_id(check) == "no-draft-path"
    assert only(lint_launch(sglang(target_dir, draft_dir)), "launch.sglang.draft_path").status == "pass"
    assert only(lint_launch(vllm_line(target_dir, draft_dir)), "launch.vllm.draft_path").status == "pass"


def test_chat_template(tmp_path, target_dir, target):
    trained, other = "{{ messages }}<|im_start|>", "{{ messages }}<think>"
    tgt = tmp_path / "tgt"
    tgt.mkdir()
    (tgt / "tokenizer_config.json").write_text(json.dumps({"chat_template": trained}))
    draft_dir = write_draft(tmp_path, copy_draft(target), "d", target=target)
    from eagle3.export.writer import record_template
    record_template(tmp_path / "nowhere", draft_dir, str(tgt))             # what export records
    sha = template.fingerprint(trained)
    assert template.recorded(json.loads((draft_dir / "config.json").read_text())) == sha
    assert sha in (draft_dir / "CARD.md").read_text()
    good = run_doctor(str(target_dir), draft_dir, probe=False,
                      tokenizer=SimpleNamespace(chat_template=trained))
    assert only(good.checks, "draft.chat_template").status == "pass" and good.ok, good.table()
    bad = run_doctor(str(target_dir), draft_dir, probe=False,
                     tokenizer=SimpleNamespace(chat_template=other))
    check = only(bad.checks, "draft.chat_template")
    assert check.status == "fail" and bad.exit_code == 1
    names_field(check, "chat template sha256", template.fingerprint(other), sha)
    # the launch line's --chat-template file
    (tmp_path / "other.jinja").write_text(other)
    (tmp_path / "trained.jinja").write_text(trained)
    line = sglang(target_dir, draft_dir) + f" --chat-template {tmp_path / 'other.jinja'}"
    check = only(lint_launch(line), "launch.sglang.chat_template")
    assert check.status == "fail" and catalog_id(check) == "chat-template"
    names_field(check, "chat template sha256", template.fingerprint(other), sha)
    line = vllm_line(target_dir, draft_dir) + f" --chat-template {tmp_path / 'trained.jinja'}"
    assert only(lint_launch(line), "launch.vllm.chat_template").status == "pass"


def offset_draft(target):
    """The right draft with one large vector added to every lm_head row: the logits' order is the
    same (a common shift), but an FP8 scale per row spent on the shift rounds the signal away."""
    draft = copy_draft(target)
    with torch.no_grad():
        draft.lm_head.weight.add_(torch.full((target.config.hidden_size,), 400.0))
    return draft


def test_quantized_draft(tmp_path, target_dir, target):
    good = write_draft(tmp_path, copy_draft(target), "good", target=target)
    line = sglang(target_dir, good) + " --speculative-draft-model-quantization fp8"
    check = only(lint_launch(line), "launch.sglang.draft_quantization")
    assert check.status == "warn" and catalog_id(check) == "quantized-draft"
    names_field(check, "--speculative-draft-model-quantization", "fp8")
    report = run_doctor(str(target_dir), good, [line], settings=PROBE)
    assert only(report.checks, "probe.quantized").status == "pass" and report.ok, report.table()
    fragile = write_draft(tmp_path, offset_draft(target), "fragile", target=target)
    report = run_doctor(str(target_dir), fragile, [line.replace(str(good), str(fragile))],
                        settings=PROBE)
    assert report.probe["tau"] >= 1.5, report.table()          # unquantized, it works
    check = only(report.checks, "probe.quantized")
    assert check.status == "fail" and report.exit_code == 1, report.table()
    assert "unquantized" in check.fix and report.probe["quantized"]["tau"] < 1.2


def test_aux_layer_ids(tmp_path, target_dir, target):
    """Already caught (tests/test_doctor.py); here: the catalog row on the finding."""
    ok_dir = write_draft(tmp_path, copy_draft(target), "ok", target=target)
    assert only(lint_launch(vllm_line(target_dir, ok_dir), versions=None),
                "launch.vllm.layer_ids").status == "pass"
    raw = write_draft(tmp_path, copy_draft(target), "raw", target=target,
                      edit=lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    report = run_doctor(str(target_dir), raw, [vllm_line(target_dir, raw)], probe=False)
    finding = as_json(report)["launch.vllm.layer_ids"]
    assert finding["status"] == "fail" and finding["catalog"] == "aux-layer-ids"
    shifted = write_draft(tmp_path, copy_draft(target), "shifted", target=target, edit=lambda c: (
        c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=list(IDS)),
        c.pop("eagle_aux_hidden_state_layer_ids", None)))
    report = run_doctor(str(target_dir), shifted, settings=PROBE)
    assert as_json(report)["probe.tau"]["catalog"] == "aux-layer-ids" and report.exit_code == 1


def test_eagle_vs_eagle3(tmp_path, target_dir, target):
    draft_dir = write_draft(tmp_path, copy_draft(target), "d", target=target)
    report = run_doctor(str(target_dir), draft_dir, [sglang(target_dir, draft_dir, algo="EAGLE")],
                        probe=False)
    finding = as_json(report)["launch.sglang.algorithm"]
    assert finding["status"] == "fail" and finding["catalog"] == "eagle-vs-eagle3"
    assert report.exit_code == 1
    assert only(lint_launch(sglang(target_dir, draft_dir)), "launch.sglang.algorithm").status == "pass"


def test_sglang_overlap(tmp_path, target_dir, target):
    draft_dir = write_draft(tmp_path, copy_draft(target), "d", target=target)
    line = "SGLANG_ENABLE_SPEC_V2=1 " + sglang(target_dir, draft_dir)
    check = only(lint_launch(line, versions={"sglang": "0.5.4"}), "launch.sglang.overlap_schedule")
    assert check.status == "warn" and "SGLang 0.5.4" in check.message
    names_field(check, "SGLANG_ENABLE_SPEC_V2", "1")
    assert not [c for c in lint_launch(sglang(target_dir, draft_dir)) if "overlap" in c.name]
    eagle2 = "SGLANG_ENABLE_SPEC_V2=1 " + sglang(target_dir, draft_dir, algo="EAGLE")
    assert not [c for c in lint_launch(eagle2) if "overlap" in c.name]


# ---------------------------------------------------------------------------- servers
class SampledDrop(FakeEngine):
    """A recorded vLLM: the greedy phases accept 2 of 3 draft tokens, the sampled phase none."""

    def __init__(self):
        super().__init__("vllm")
        self.calls = 0

    def generate(self, max_tokens: int) -> None:
        self.calls += 1
        greedy = sum(len(p.prompts) for p in PHASES if p.greedy)
        self.accept = 2 if self.calls <= greedy else 0
        super().generate(max_tokens)


def test_sampled_argmax():
    report = run_fake(SampledDrop())
    check = only(report.checks, "server.sampled_acceptance")
    assert check.status == "warn" and report.exit_code == 0 and report.strict_exit_code() == 1
    names_field(check, "sampled tau", "1.00", "3.00")
    assert catalog_id(check) == "sampled-argmax-draft"
    assert only(run_fake(FakeEngine("vllm")).checks, "server.sampled_acceptance").status == "pass"
    # an engine that drafts for sampled requests from the distribution: no such warning
    same = LiveStats(3.0, [], 4, 8)
    low = PhaseResult(PHASES[2], 12, 1.0, LiveStats(1.0, [], 12, 0))
    assert argmax_check(ServerInfo(replace(LIVE_VLLM, argmax_draft=False), []), same, [low]) == []


class LostDraftDecoder(GroupedDecoder):
    """Suffix-only blocks accept `depth` tokens; the draft's own blocks accept nothing (its weights
    lost): an adaptive server's overall tau still looks healthy."""

    def step(self) -> Step:
        arm = self.arms[self.steps % len(self.arms)]
        self.steps += 1
        if arm != "suffix":
            return Step(self.plain.step().tokens, 0, proposed=self.depth, arm=arm)
        tokens = [t for _ in range(self.depth + 1) for t in self.plain.step().tokens]
        return Step(tokens, self.depth, proposed=self.depth, accepted_suffix=self.depth, arm=arm)


class LostDraftEngine(GroupedEngine):
    def make_decoder(self, params, speculative: bool = True):
        plain = super().make_decoder(params, False)
        if not speculative:
            return plain
        return LostDraftDecoder(plain, self.spec.depth, arms=("suffix", "suffix", "tree2x2n3"))


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def test_draft_weights_lost(capsys):
    target = tiny_target()
    engine = LostDraftEngine(target, tokenizer(), max_model_len=256)
    engine.draft_name = "drafts/random-weights"
    with RunningServer(create_app(engine, model_name="tiny", api_key=KEY)) as s:
        code = doctor_main(["--server", s.url, "--api-key", KEY, "--max-tokens", "40", "--json"])
        health = get_json(s.url + "/health")
        metrics = get_text(s.url + "/metrics")
    report = json.loads(capsys.readouterr().out)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["server.tau"]["status"] == "pass"              # suffix blocks hide it
    draft = checks["server.draft"]
    assert code == 1 and draft["status"] == "fail" and draft["catalog"] == "draft-weights-lost"
    assert "drafts/random-weights" in draft["message"] and "tau 1.00" in draft["message"]
    assert "weights are lost or random" in draft["fix"]
    assert health["status"] == "degraded" and health["draft"]["collapsed"]
    assert health["draft"]["name"] == "drafts/random-weights" and health["draft"]["tau"] == 1.0
    assert "eagle3:spec_decode_draft_steps_total" in metrics
    # the same server with a draft that accepts: passes, /health ok
    good = GroupedEngine(target, tokenizer(), max_model_len=256)
    with RunningServer(create_app(good, model_name="tiny", api_key=KEY)) as s:
        report = run_server_doctor(s.url, KEY, settings=FAST)
        health = get_json(s.url + "/health")
    assert only(report.checks, "server.draft").status == "pass" and report.exit_code == 0, report.table()
    assert health["status"] == "ok" and not health["draft"]["collapsed"]


def test_draft_watch_counts_only_the_drafts_own_proposals():
    watch = DraftWatch(min_steps=2)
    for step in (Step([1, 2, 3], 2, proposed=3, accepted_suffix=2, arm="suffix"),
                 Step([1], 0, arm="plain"), Step([1], 0, proposed=3, arm="tree4x3n8"),
                 Step([1, 2], 1, proposed=3, accepted_suffix=1, arm="draft")):   # merged: suffix's
        watch.observe(step)
    assert (watch.steps, watch.accepted) == (2, 0) and watch.collapsed
    watch.observe(Step([1, 2, 3], 2, proposed=3, arm="draft"))
    assert watch.tau == pytest.approx(1 + 2 / 3) and not watch.collapsed



# ---------------------------------------------------------------------------- the shipped draft
def shipped_copy(tmp_path: Path, name: str, state_edit=None, config_edit=None) -> Path:
    import shutil
    out = tmp_path / name
    shutil.copytree(ROOT / "eagle3" / "drafts" / "smollm2-135m-eagle3", out)
    if state_edit is not None:
        state = load_file(str(out / "model.safetensors"))
        state_edit(state)
        save_file(state, str(out / "model.safetensors"))
    if config_edit is not None:
        cfg = json.loads((out / "config.json").read_text())
        config_edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def permute_d2t(state: dict) -> None:
    """d2t rebuilt: the same target tokens, in another order (t2d unchanged)."""
    d2t = state["d2t"].long()
    targets = torch.arange(d2t.numel()) + d2t
    shuffled = targets[torch.randperm(d2t.numel(), generator=torch.Generator().manual_seed(0))]
    state["d2t"] = (shuffled - torch.arange(d2t.numel())).to(state["d2t"].dtype)


@pytest.mark.real
def test_broken_deployments_of_the_shipped_draft(tmp_path, real_model):
    """The shipped draft and its exported launch lines pass; each deployment broken from them fails
    (exit 1) naming the field."""
    from eagle3.export.writer import launch_lines
    model, tok, src = real_model
    good = shipped_copy(tmp_path, "good")
    lines = launch_lines(good, src.hf_dir, num_steps=5, topk=4, num_draft_tokens=8)
    report = run_doctor(model, good, [lines.sglang, lines.vllm], probe=False, tokenizer=tok)
    assert report.ok, report.table()
    assert only(report.checks, "contract.d2t_rows").status == "pass"

    def fails(draft_dir: Path, line: str, name: str) -> None:
        found = run_doctor(model, draft_dir, [line] if line else [], probe=False, tokenizer=tok)
        check = [c for c in found.checks if c.name == name]
        assert found.exit_code == 1 and check and check[0].status == "fail", found.table()
        assert check[0].field and check[0].fix

    def drop_map(state: dict) -> None:
        state.pop("d2t"), state.pop("t2d", None)

    fails(shipped_copy(tmp_path, "no_d2t", drop_map), "", "draft.d2t")
    fails(shipped_copy(tmp_path, "permuted", permute_d2t), "", "contract.d2t_rows")
    short = shipped_copy(tmp_path, "short", config_edit=lambda c: c.update(max_position_embeddings=2048))
    fails(short, lines.sglang.replace(str(good), str(short)) + " --context-length 8192",
          "launch.sglang.context_length")
    fails(good, lines.sglang + " --speculative-token-map hot.pt", "launch.sglang.token_map")
    spec = lines.vllm.replace('"num_speculative_tokens"', '"disable_by_batch_size": 4, '
                              '"num_speculative_tokens"')
    assert "disable_by_batch_size" in spec
    fails(good, spec, "launch.vllm.disable_by_batch_size")
    no_path = lines.sglang.replace(f"--speculative-draft-model-path {good}", "")
    assert "--speculative-draft-model-path" not in no_path
    fails(good, no_path, "launch.sglang.draft_path")


def test_draft_lost_mid_run_fails_on_the_servers_collapsed_flag():
    """Weights lost after a good start: the lifetime tau still passes, the recent window does not."""
    from eagle3.doctor.server import draft_check
    from eagle3.engines import LIVE_EAGLE3
    info = ServerInfo(LIVE_EAGLE3, ["tiny"], {"draft": {"name": "d"}}, "/health")
    counters = Counters(draft_steps=200.0, draft_accepted=150.0)
    ok = draft_check(info, counters, FAST, {"name": "d", "collapsed": False})
    assert [c.status for c in ok] == ["pass"]
    lost = draft_check(info, counters, FAST, {"name": "d", "collapsed": True})
    assert lost[0].status == "fail" and lost[0].field == "draft collapsed"
    assert "the draft d" in lost[0].message and "weights are lost" in lost[0].fix
