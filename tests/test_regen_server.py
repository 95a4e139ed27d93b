"""Regeneration through an OpenAI-compatible server: the same records as the in-process path (the
reply's ids, eos appended where the server stopped on it), resumable by id, and the text tokenized
where a server does not return ids."""
from __future__ import annotations

import json

import pytest

from eagle3.errors import InputError
from eagle3.generate import Engine, SamplingParams
from eagle3.serve import create_app
from eagle3.train.data import Prompt
from eagle3.train.regen import RegenConfig, RegenJob
from eagle3.train.regen_server import Completion, ServerClient, run_regen_server

from serve_fixtures import RunningServer, tiny_target, tokenizer

PROMPTS = [Prompt("a_0", "Name a colour."), Prompt("b_0", "Count to three."), Prompt("c_0", "Say hello.")]


def job(tmp_path, prompts=PROMPTS) -> RegenJob:
    return RegenJob(list(prompts), tmp_path / "conversations.jsonl", tmp_path / "manifest.json",
                    {"prompts": "test"})


def records(path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_replies_through_our_server_equal_the_engine_alone_and_resume(tmp_path):
    tok = tokenizer()
    engine = Engine(tiny_target(), tok, max_model_len=160)
    cfg = RegenConfig(max_new_tokens=12, temperatures=(0.0,))
    eos = min(engine.eos_ids)
    app = create_app(Engine(tiny_target(), tok, max_model_len=160), model_name="tiny", max_batch=4)
    with RunningServer(app) as s:
        m = run_regen_server(ServerClient(s.url), tok, job(tmp_path), cfg, eos, concurrency=3)
        again = run_regen_server(ServerClient(s.url), tok, job(tmp_path), cfg, eos, concurrency=3)
    got = records(tmp_path / "conversations.jsonl")
    assert sorted(got) == ["a_0", "b_0", "c_0"] and len((tmp_path / "conversations.jsonl").read_text()
                                                          .splitlines()) == 3     # resumed: nothing twice
    for p in PROMPTS:
        r = got[p.id]
        alone = engine.generate(params=SamplingParams(temperature=0.0, max_new_tokens=12),
                                prompt_ids=r["prompt_ids"])
        want = alone.token_ids + ([eos] if alone.finish_reason == "stop" else [])
        assert r["response_ids"] == want and r["finish"] == ("eos" if alone.finish_reason == "stop"
                                                             else "length")
    assert m["conversations"] == 3 and m["server"] == s.url and again["conversations"] == 3
    assert m["reply_ids"] == "the server's token_ids"
    assert json.loads((tmp_path / "manifest.json").read_text())["new_tokens"] == m["new_tokens"]


class TextOnly(ServerClient):
    """A server that refuses `return_token_ids` (400) and answers text."""

    def __init__(self):
        super().__init__("http://stub")
        self.bodies = []

    def _post(self, body: dict) -> dict:
        from eagle3.train.regen_server import _Refused
        self.bodies.append(body)
        if body.get("return_token_ids"):
            raise _Refused("HTTP 400: unsupported field 'return_token_ids'")
        return {"choices": [{"text": " hello world", "finish_reason": "length"}]}


def test_a_server_without_token_ids_gets_its_text_tokenized():
    tok = tokenizer()
    client = TextOnly()
    out = client.complete([1, 2, 3], 8, 0.0, 5, tok)
    assert out == Completion(tok.encode(" hello world", add_special_tokens=False), False)
    assert client.bodies[0]["return_token_ids"] and "return_token_ids" not in client.bodies[1]
    client.complete([1, 2, 3], 8, 0.0, 5, tok)
    assert len(client.bodies) == 3                          # asked once, then text from the start
    assert client.bodies[1]["seed"] == 5 and client.bodies[1]["prompt"] == [1, 2, 3]


def test_an_unreachable_server_names_the_fix(tmp_path):
    with pytest.raises(InputError, match="unreachable.*start the server"):
        ServerClient("http://127.0.0.1:9", timeout_s=2).complete([1], 4, 0.0, 0, tokenizer())
    with pytest.raises(InputError, match="concurrency=0"):
        run_regen_server(ServerClient("http://x"), tokenizer(), job(tmp_path), RegenConfig(), 0,
                         concurrency=0)


def test_token_ids_are_refused_on_a_stream():
    from eagle3.serve.protocol import APIError, CompletionRequest, parse_request
    body = json.dumps({"prompt": [1, 2], "stream": True, "return_token_ids": True}).encode()
    with pytest.raises(APIError, match="whole responses only") as e:
        parse_request(CompletionRequest, body)
    assert e.value.param == "return_token_ids"
    assert parse_request(CompletionRequest, json.dumps({"prompt": [1], "return_token_ids": True})
                         .encode()).return_token_ids


class Stops(ServerClient):
    """A server that answers ids and stops at the end-of-text token where the prompt ends on an even id."""

    def __init__(self):
        super().__init__("http://stub")

    def _post(self, body: dict) -> dict:
        stop = body["prompt"][-1] % 2 == 0
        return {"choices": [{"text": "", "token_ids": [7, 8], "finish_reason": "stop" if stop else "length"}]}


def test_a_reply_that_stopped_on_eos_ends_with_it(tmp_path):
    tok = tokenizer()
    cfg = RegenConfig(max_new_tokens=2, temperatures=(0.0, 1.0))
    m = run_regen_server(Stops(), tok, job(tmp_path), cfg, eos_id=99, concurrency=2)
    got = records(tmp_path / "conversations.jsonl")
    for r in got.values():
        stopped = r["prompt_ids"][-1] % 2 == 0
        assert r["response_ids"] == [7, 8] + ([99] if stopped else [])
        assert r["finish"] == ("eos" if stopped else "length")
    assert [got[p.id]["temperature"] for p in PROMPTS] == [0.0, 1.0, 0.0]
    assert m["finished_eos"] == sum(r["finish"] == "eos" for r in got.values())


class Ignores(ServerClient):
    """A server that takes `return_token_ids` without a word and answers text only."""

    def __init__(self):
        super().__init__("http://stub")

    def _post(self, body: dict) -> dict:
        return {"choices": [{"text": " hi", "finish_reason": "length"}]}


def test_a_server_that_ignores_token_ids_is_not_taken_for_one_that_sent_them(tmp_path, capsys):
    m = run_regen_server(Ignores(), tokenizer(), job(tmp_path), RegenConfig(max_new_tokens=2), 0)
    assert m["reply_ids"] == "tokenized text" and "ignores return_token_ids" in capsys.readouterr().err


class OtherModel(ServerClient):
    """A server of another model: ids past the target's vocabulary."""

    def __init__(self):
        super().__init__("http://stub")

    def _post(self, body: dict) -> dict:
        return {"choices": [{"text": "", "token_ids": [5, 10 ** 7], "finish_reason": "length"}]}


def test_ids_outside_the_targets_vocabulary_name_the_wrong_server():
    with pytest.raises(InputError, match="outside the target's vocabulary.*another model"):
        OtherModel().complete([1, 2], 2, 0.0, 0, tokenizer())
