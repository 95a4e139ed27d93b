"""Training data: ShareGPT parsing (truncated array), prompt selection, dataset replies, multi-file data."""
import json

import pytest

from eagle3.train.config import TrainConfig
from eagle3.train.data import select_prompts
from eagle3.train.real import load_data
from eagle3.train.regen import RegenJob, write_dataset_responses


def record(i, human, gpt=None):
    conv = [{"from": "human", "value": human}] + ([{"from": "gpt", "value": gpt}] if gpt is not None else [])
    return {"id": f"r{i}", "conversations": conv}


@pytest.fixture
def sources(tmp_path):
    recs = [record(0, "How do plants turn sunlight into sugar?", "Plants use photosynthesis."),
            record(1, "How do plants   turn sunlight into sugar?", "A duplicate once normalised."),
            record(2, "Compose an engaging travel blog post about a recent trip to Hawaii, please",
                   "Overlaps MT-bench."),
            record(3, "Name three rivers in Europe.", None),
            record(4, "What is a prime number, in simple words?", "A number with exactly two divisors.")]
    text = json.dumps(recs)
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(text[:-40])            # truncated inside the last record, as the packaged file is
    mtbench = tmp_path / "question.jsonl"
    mtbench.write_text(json.dumps({"question_id": 81, "turns": [
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
        "experiences and must-see attractions.", "Rewrite your previous response."]}) + "\n")
    return sharegpt, mtbench


def test_selection_parses_a_truncated_array_drops_duplicates_and_mtbench(sources):
    prompts, stats = select_prompts(*sources)
    assert [p.id for p in prompts] == ["r0", "r3"]          # r4 was cut off by the truncation
    assert stats == {"records": 4, "duplicate": 1, "mtbench_overlap": 1, "kept": 2}
    assert prompts[0].response == "Plants use photosynthesis."
    assert prompts[1].response is None


def test_dataset_replies_are_templated_terminated_resumable(sources, tmp_path):
    from eagle3.runtime.loader import load_tokenizer, resolve_model
    tok = load_tokenizer(resolve_model(None).hf_dir)
    prompts, _ = select_prompts(*sources)
    job = RegenJob(prompts, tmp_path / "c.jsonl", tmp_path / "m.json", {"prompts": "test"})
    m = write_dataset_responses(tok, job, tok.eos_token_id)
    recs = [json.loads(line) for line in job.out_jsonl.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["r0"] and m["skipped"] == {"no_reply": 1}
    r = recs[0]
    assert tok.decode(r["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert r["response_ids"][-1] == tok.eos_token_id and r["finish"] == "dataset"
    assert tok.decode(r["response_ids"][:-1]) == "Plants use photosynthesis."
    assert m["response_tokens"] == len(r["response_ids"])
    # a second call adds nothing; a cut reply carries no eos; excluded ids are skipped
    assert write_dataset_responses(tok, job, tok.eos_token_id)["conversations"] == 1
    assert len(job.out_jsonl.read_text().splitlines()) == 1
    job2 = RegenJob(prompts, tmp_path / "d.jsonl", tmp_path / "n.json", {})
    write_dataset_responses(tok, job2, tok.eos_token_id, max_response_tokens=2)
    cut = json.loads(job2.out_jsonl.read_text())
    assert len(cut["response_ids"]) == 2 and tok.eos_token_id not in cut["response_ids"]
    job3 = RegenJob(prompts, tmp_path / "e.jsonl", tmp_path / "o.json", {})
    assert write_dataset_responses(tok, job3, 2, exclude=frozenset({"r0"}))["conversations"] == 0
    # a fresh checkout keeps the committed manifest but not the ignored jsonl: it is rebuilt, not
    # taken as done
    job.out_jsonl.unlink()
    assert write_dataset_responses(tok, job, tok.eos_token_id) == m
    assert len(job.out_jsonl.read_text().splitlines()) == 1


def two_data_files(tmp_path) -> list[str]:
    """c0.jsonl and c1.jsonl, three samples each; the response id of sample i of file k is 10k+i."""
    files = []
    for k in range(2):
        f = tmp_path / f"c{k}.jsonl"
        f.write_text("".join(json.dumps({"id": f"{k}{i}", "prompt_ids": [1, 2], "response_ids": [10 * k + i]}) + "\n"
                             for i in range(3)))
        files.append(str(f))
    return files


def test_data_files_are_read_in_order(tmp_path):
    files = two_data_files(tmp_path)
    cfg = TrainConfig.from_dict({"data": files, "out": str(tmp_path / "run")})
    assert cfg.data_paths == [tmp_path / "c0.jsonl", tmp_path / "c1.jsonl"]
    assert [int(s.ids[-1]) for s in load_data(cfg)[0]] == [0, 1, 2, 10, 11, 12]
    assert TrainConfig(data=files[0]).data_paths == [tmp_path / "c0.jsonl"]


def test_a_resumed_run_keeps_its_files_counts_and_refuses_other_files(tmp_path):
    import torch
    from eagle3.errors import ContractError
    from eagle3.train.store import part_name
    files = two_data_files(tmp_path)
    cfg = TrainConfig.from_dict({"data": files[:1], "eval_data": files[1], "out": str(tmp_path / "run")})
    (tmp_path / "run").mkdir()
    torch.save({"num_samples": 5, "parts": [[part_name(tmp_path / "c0.jsonl"), 2, False],
                                            [part_name(tmp_path / "c1.jsonl"), 3, True]]},
               tmp_path / "run" / "checkpoint.pt")
    samples, parts = load_data(cfg)                       # the file grew since: the run keeps 2
    assert [int(s.ids[-1]) for s in samples] == [0, 1, 10, 11, 12]
    assert [(p.count, p.held_out) for p in parts] == [(2, False), (3, True)]
    swapped = TrainConfig.from_dict({"data": files[1:], "eval_data": files[0], "out": str(tmp_path / "run")})
    with pytest.raises(ContractError, match="data / eval_data"):
        load_data(swapped)
