"""Learning from traffic: capture, the learner's round (resume, gate, versions), faults, the swap."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from eagle3.errors import ContractError
from eagle3.learn import versions
from eagle3.learn.capture import TrafficCapture, check_identity, traffic_shards
from eagle3.learn.gate import judge, non_finite
from eagle3.learn.traffic import heldout_split, openai_records, read_shard
from eagle3.train.features import load_conversations
from spec_helpers import one_thread  # noqa: F401  (fixture)


def write_shard(root: Path, seq: int, records: list[dict]) -> Path:
    tokens = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in records)
    path = root / "traffic" / f"t-{seq:06d}-n{tokens}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def conv(seed: int, n: int = 24, vocab: int = 96) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (n,), generator=g).tolist()
    # a repeating pattern the draft can learn: every reply is its prompt's tail, twice
    return {"prompt_ids": ids[:8], "response_ids": (ids[8:16] * 2)[:n - 8]}


# ---------------------------------------------------------------------------- capture
def test_capture_writes_shards_the_trainer_reads_and_bounds_their_size(tmp_path):
    cap = TrafficCapture(tmp_path, max_bytes=10_000, flush_records=4, flush_s=0.05)
    for i in range(12):
        cap.record(list(range(10 + i)), list(range(50, 70)), 0.0)
    cap.close()
    shards = traffic_shards(tmp_path)
    assert shards and all(not p.name.endswith(".tmp") for p in shards)
    samples = [s for p in shards for s in load_conversations(p, 512)]
    assert len(samples) == 12 and samples[0].loss_mask.sum() == 20
    assert cap.tokens_written == sum(10 + i + 20 for i in range(12))
    small = TrafficCapture(tmp_path / "small", max_bytes=600, flush_records=1, flush_s=0.01)
    for i in range(6):
        small.record(list(range(30)), list(range(30)), 0.0)
        small.flush()
    small.close()
    kept = traffic_shards(tmp_path / "small")
    assert small.dropped_shards > 0 and kept[-1].name.startswith("t-000006")   # oldest dropped first
    assert sum(p.stat().st_size for p in kept) <= 600


def test_a_full_disk_loses_nothing_and_logs_once(tmp_path, monkeypatch, caplog):
    import eagle3.learn.capture as capture
    cap = TrafficCapture(tmp_path, max_bytes=1 << 20, flush_records=100, flush_s=60)
    real = capture.write_atomic
    fail = {"left": 2}

    def full(path, text):
        if fail["left"]:
            fail["left"] -= 1
            raise OSError(28, "No space left on device")
        real(path, text)
    monkeypatch.setattr(capture, "write_atomic", full)
    with caplog.at_level(logging.INFO, logger="eagle3.learn"):
        cap.record([1, 2, 3], [4, 5], 0.0)
        assert not cap.flush()
        cap.record([6, 7], [8, 9], 1.0)
        assert not cap.flush()
        assert cap.flush()
    cap.close()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "No space left" in errors[0].getMessage()
    recs = [r for p in traffic_shards(tmp_path) for r in read_shard(p).records]
    assert [r["response_ids"] for r in recs] == [[4, 5], [8, 9]]


def test_a_truncated_shard_keeps_its_complete_conversations(tmp_path, caplog):
    path = write_shard(tmp_path, 1, [conv(i) for i in range(3)])
    path.write_text(path.read_text()[:-30])                    # the last line cut
    with caplog.at_level(logging.WARNING, logger="eagle3.learn"):
        shard = read_shard(path)
    assert len(shard.records) == 2
    assert len([r for r in caplog.records if "damaged" in r.getMessage()]) == 1


def test_a_directory_of_another_target_is_refused(tmp_path):
    check_identity(tmp_path, {"model": "a", "vocab_size": 96})
    check_identity(tmp_path, {"model": "a", "vocab_size": 96})
    with pytest.raises(ContractError, match="vocab_size"):
        check_identity(tmp_path, {"model": "a", "vocab_size": 97})


def test_heldout_tail_stays_held_out(tmp_path):
    shards = [write_shard(tmp_path, i, [conv(i)]) for i in range(1, 11)]
    train, held = heldout_split(shards, 0.2, [])
    assert held == shards[-2:] and train == shards[:-2]
    more = shards + [write_shard(tmp_path, 11, [conv(11)])]
    train2, held2 = heldout_split(more, 0.2, [p.name for p in held])
    assert set(held) <= set(held2) and not set(held2) & set(train2)


def test_openai_logs_become_id_records():
    from serve_fixtures import tokenizer
    tok = tokenizer()
    line = {"messages": [{"role": "user", "content": "Hi"}], "choices": [{"message": {"content": "Hello!"}}]}
    path = Path(__file__).parent / "__tmp_openai.jsonl"
    try:
        path.write_text(json.dumps(line) + "\n" + json.dumps(
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}) + "\n")
        recs = openai_records(path, tok)
    finally:
        path.unlink()
    assert tok.decode(recs[0]["response_ids"], skip_special_tokens=True) == "Hello!"
    assert tok.decode(recs[1]["response_ids"], skip_special_tokens=True) == "Yo"
    assert recs[0]["prompt_ids"] == recs[1]["prompt_ids"]


# ---------------------------------------------------------------------------- gate
def test_the_gate_needs_the_margin_and_finite_weights():
    served = {"est_tau": 1.5}
    assert judge({"est_tau": 1.6}, served, 0.02).passed
    assert not judge({"est_tau": 1.52}, served, 0.02).passed
    assert judge({"est_tau": 1.1}, None, 0.02).passed            # no draft served: 1.0
    layer = torch.nn.Linear(2, 2)
    assert non_finite(layer) is None
    with torch.no_grad():
        layer.weight[0, 0] = float("nan")
    assert non_finite(layer) == "weight"
    assert not judge({"est_tau": 9.0}, served, 0.02, non_finite(layer)).passed


# ---------------------------------------------------------------------------- the learner's round
@pytest.fixture
def learn_dir(tmp_path):
    """A learn directory of the tiny target: v0 a reduced-vocabulary draft, 4 traffic shards."""
    from eagle3.draft.formats import save_draft
    from eagle3.train.tiny import tiny_draft, tiny_target
    from eagle3.train.vocab import build_vocab
    target = tiny_target()
    vocab = build_vocab(torch.arange(96).flip(0).float(), 64)
    draft = tiny_draft(target, vocab)
    v0 = save_draft(draft, tmp_path / "shipped", "specforge", target.config)
    root = tmp_path / "learn"
    for s in range(4):
        write_shard(root, s + 1, [conv(10 * s + i) for i in range(6)])
    versions.ensure_v0(root, v0)
    return root, target, draft


def tiny_learn_config(root: Path, **kw):
    from eagle3.learn.learner import LearnConfig
    return LearnConfig(str(root), heldout_fraction=0.25, epochs=2, batch_size=4, max_len=64,
                       checkpoint_s=0.0, autocast="none", **kw)


def test_a_round_publishes_a_version_with_its_card_and_keeps_d2t(learn_dir, one_thread):
    from eagle3.draft.formats import load_draft
    from eagle3.learn.learner import learn_round, pending_tokens, read_state
    root, target, served = learn_dir
    assert pending_tokens(root) > 0
    card = learn_round(tiny_learn_config(root, margin=-1.0), target)   # margin -1: always passes
    v = card["version"]
    assert v == 1 and versions.current(root) == 1 and card["status"] == "served"
    on_disk = versions.card(root, 1)
    assert on_disk["gate"]["served"]["est_tau"] >= 1.0 and on_disk["steps"] > 0
    assert on_disk["data"]["traffic_shards"] == 3 and on_disk["data"]["heldout_shards"] == 1
    learned = load_draft(versions.draft_path(root, 1), target.config, target=target).draft
    assert torch.equal(learned.d2t, served.d2t) and torch.equal(learned.t2d, served.t2d)
    assert not torch.equal(learned.fc.weight, served.fc.weight)
    state = read_state(root)
    assert state["in_progress"] is None and pending_tokens(root) == 0
    assert set(state["heldout"]).isdisjoint(state["trained"])


def test_a_learner_killed_mid_step_resumes_its_round(learn_dir, one_thread):
    from eagle3.learn.learner import learn_round, read_state
    root, target, _ = learn_dir
    calls = {"n": 0}

    def killed_at_step_three():
        calls["n"] += 1
        if calls["n"] == 9:            # the start, 5 feature parts, then training steps
            raise SystemExit("killed")
    with pytest.raises(SystemExit):
        learn_round(tiny_learn_config(root, margin=-1.0), target, killed_at_step_three)
    plan = read_state(root)["in_progress"]
    assert plan["round"] == 1 and (root / "learner" / "round-1" / "checkpoint.pt").is_file()
    log_before = (root / "learner" / "round-1" / "train_log.jsonl").read_text().splitlines()
    card = learn_round(tiny_learn_config(root, margin=-1.0), target)
    steps = [json.loads(x)["step"] for x in
             (root / "learner" / "round-1" / "train_log.jsonl").read_text().splitlines()]
    assert card["round"] == 1 and steps[:len(log_before)] == list(range(1, len(log_before) + 1))
    assert steps == list(range(1, len(steps) + 1))              # resumed, not restarted
    assert versions.current(root) == 1


def test_a_candidate_with_nan_weights_is_rejected_and_v0_keeps_serving(learn_dir, monkeypatch, caplog, one_thread):
    import eagle3.learn.learner as learner
    root, target, _ = learn_dir
    real = learner.train

    def nan_train(*a, **kw):
        draft = real(*a, **kw)
        with torch.no_grad():
            draft.fc.weight[0, 0] = float("nan")
        return draft
    monkeypatch.setattr(learner, "train", nan_train)
    with caplog.at_level(logging.WARNING, logger="eagle3.learn"):
        card = learner.learn_round(tiny_learn_config(root, margin=-1.0), target)
    assert card["status"] == "rejected" and "non-finite" in card["gate"]["reason"]
    assert versions.current(root) == 0
    assert not (root / "drafts" / "v1" / "model.safetensors").exists()
    assert len([r for r in caplog.records if "rejected" in r.getMessage()]) == 1


class ByteTokenizer:
    """Characters as ids 4..95 (the tiny target's vocabulary), a one-line chat template."""
    eos_token_id = 3

    def encode(self, text, add_special_tokens=False):
        return [4 + ord(c) % 92 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [1] + [t for m in messages for t in self.encode(m["role"] + ":" + m["content"])] + [2]


def test_train_from_an_openai_log_runs_a_round_and_exports(tmp_path, monkeypatch, one_thread):
    import eagle3.learn.process as process
    from eagle3.train.tiny import tiny_target
    target = tiny_target()
    monkeypatch.setattr(process, "load_reference", lambda model: (target, ByteTokenizer()))
    log = tmp_path / "vllm.jsonl"
    with open(log, "w") as f:
        for i in range(12):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"sort list {i} please"}],
                                "response": "def f(x):\n    return sorted(x)\n" * 2}) + "\n")
    out = tmp_path / "learn"
    argv = ["--from-traffic", str(log), "--out", str(out), "--draft", "none", "--epochs", "2",
            "--margin", "-1", "--heldout-fraction", "0.25", "--autocast", "none"]
    assert process.from_traffic_main(argv) == 0
    assert versions.current(out) == 1 and versions.card(out, 0)["source"] is None
    assert (out / "drafts" / "v1" / "config.json").is_file()
    assert (out / "drafts" / "v1-speculators" / "config.json").is_file()
    recs = [r for p in traffic_shards(out) for r in read_shard(p).records]
    assert len(recs) == 12 and recs[0]["response_ids"][-1] == 3        # the reply ends with eos


def test_the_learner_waits_while_the_server_is_busy(tmp_path):
    import threading
    import time
    from eagle3.learn.learner import pause_path, wait_while_paused
    hook = wait_while_paused(tmp_path, poll_s=0.01)
    hook()                                             # no pause file: returns at once
    pause_path(tmp_path).parent.mkdir(parents=True)
    pause_path(tmp_path).touch()
    done = threading.Event()
    threading.Thread(target=lambda: (hook(), done.set()), daemon=True).start()
    time.sleep(0.2)
    assert not done.is_set()
    pause_path(tmp_path).unlink()
    assert done.wait(2)


def test_a_rejected_candidate_keeps_its_weights_but_not_the_service(learn_dir, one_thread):
    from eagle3.learn.learner import learn_round
    root, target, _ = learn_dir
    card = learn_round(tiny_learn_config(root, margin=100.0), target)
    assert card["status"] == "rejected" and versions.current(root) == 0
    assert (root / "drafts" / "v1" / "model.safetensors").is_file()
    assert versions.card(root, 1)["gate"]["candidate"]["est_tau"] >= 1.0


def test_a_served_draft_is_fine_tuned_gently_and_a_first_draft_is_not(tmp_path):
    """The round's peak lr and epochs: FINE_TUNE_LR and FINE_TUNE_EPOCHS when it starts from a
    served draft (3e-4 first undid what the shipped draft knew), FIRST_DRAFT_LR and the more
    passes of FIRST_DRAFT_EPOCHS for a first draft; configured values win over both."""
    from eagle3.learn.learner import (FINE_TUNE_EPOCHS, FINE_TUNE_LR, FIRST_DRAFT_EPOCHS, FIRST_DRAFT_LR,
                                      LearnConfig, train_config)
    served, held = tmp_path / "v0", tmp_path / "h.jsonl"

    def config(served, **kw):
        return train_config(LearnConfig(str(tmp_path), **kw), tmp_path / "r", [tmp_path / "t.jsonl"], held, served)
    tune, first = config(served), config(None)
    assert (tune.lr, tune.epochs, tune.init_from) == (FINE_TUNE_LR, FINE_TUNE_EPOCHS, str(served))
    assert (first.lr, first.epochs, first.init_from) == (FIRST_DRAFT_LR, FIRST_DRAFT_EPOCHS, None)
    assert FINE_TUNE_LR < FIRST_DRAFT_LR and FINE_TUNE_EPOCHS < FIRST_DRAFT_EPOCHS
    set_lr = config(served, lr=1e-4, epochs=5)
    assert (set_lr.lr, set_lr.epochs) == (1e-4, 5) and set_lr.eval_every == 0   # the gate alone reads the held-out part
    curve = config(served, eval_every=16)
    assert curve.eval_every == 16 and curve.eval_data == str(held)
