"""Server pieces without HTTP: request parsing, draft-token spans, metrics, the engine queue."""
from __future__ import annotations

import asyncio
import json
import logging
import sys
import time

import pytest

from eagle3.generate import Chunk, SamplingParams
from eagle3.generate.scheduler import Emitted, Scheduler
from eagle3.generate.types import Step
from eagle3.serve.highlight import DraftSpans
from eagle3.serve.metrics import ServerMetrics
from eagle3.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, parse_request,
                                   requested_max_tokens, sampling_params)
from eagle3.serve.queue import END, EngineWorker, Job, QueueFull
from serve_fixtures import tokenizer


def chat_body(**extra) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **extra}).encode()


# ---------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("extra, param, code", [
    ({"tools": []}, "tools", "unsupported_field"),
    ({"max_tokens": "5"}, "max_tokens", "invalid_value"),          # strict: no str -> int
    ({"max_tokens": 5.0}, "max_tokens", "invalid_value"),
    ({"temperature": -0.1}, "temperature", "invalid_value"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"n": 3}, "n", "unsupported_value"),
    ({"n": True}, "n", "invalid_value"),
    ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_value"),
    ({"logprobs": True}, "logprobs", "unsupported_value"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"seed": -1}, "seed", "invalid_value"),
])
def test_parse_rejects_with_the_field_named(extra, param, code):
    with pytest.raises(APIError) as e:
        parse_request(ChatCompletionRequest, chat_body(**extra))
    assert e.value.status == 400 and e.value.param == param and e.value.code == code
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


def test_parse_accepts_neutral_values_and_maps_sampling():
    req = parse_request(ChatCompletionRequest, chat_body(n=1, presence_penalty=0, logprobs=False,
                                                         temperature=0, top_k=-1, stop="x",
                                                         max_completion_tokens=7, seed=3))
    assert requested_max_tokens(req) == 7
    params = sampling_params(req, 7)
    assert params == SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=3, max_new_tokens=7,
                                    stop=("x",))
    default = sampling_params(parse_request(ChatCompletionRequest, chat_body()), 5)
    assert default.temperature == 1.0 and default.top_k == 0     # the OpenAI default temperature
    assert default.speculative
    assert not sampling_params(parse_request(ChatCompletionRequest, chat_body(speculation=False)), 5).speculative


def test_parse_completion_defaults_and_conflicts():
    req = parse_request(CompletionRequest, b'{"prompt": [1, 2, 3]}')
    assert req.prompt == [1, 2, 3] and requested_max_tokens(req) == 16
    with pytest.raises(APIError, match="disagree"):
        requested_max_tokens(parse_request(ChatCompletionRequest,
                                           chat_body(max_tokens=3, max_completion_tokens=4)))
    with pytest.raises(APIError, match="at most 4"):
        sampling_params(parse_request(ChatCompletionRequest, chat_body(stop=list("abcde"))), 4)


# ---------------------------------------------------------------------------- draft spans
def test_spans_cover_the_text_and_flag_the_drafted_tokens():
    tok = tokenizer()
    ids = tok.encode("Speculative decoding drafts tokens, then the target checks them 😀 ok.",
                     add_special_tokens=False)
    flags = [i % 3 != 2 for i in range(len(ids))]
    spans = DraftSpans(tok)
    for i in range(0, len(ids), 3):                  # chunks of 3 tokens, like a speculative step
        spans.push(ids[i:i + 3], flags[i:i + 3])
    full = tok.decode(ids, skip_special_tokens=True)
    runs = spans.segments(0, full)
    assert "".join(t for t, _ in runs) == full
    drafted_chars = sum(len(t) for t, d in runs if d)
    pieces = [tok.decode(ids[:k + 1]).rstrip("\ufffd") for k in range(len(ids))]
    expect = sum(len(pieces[k]) - len(pieces[k - 1] if k else "") for k in range(len(ids))
                 if flags[k])
    assert drafted_chars == expect > 0
    assert all(a[1] != b[1] for a, b in zip(runs, runs[1:]))       # runs are maximal


def test_spans_of_a_later_delta():
    tok = tokenizer()
    ids = tok.encode(" alpha beta gamma", add_special_tokens=False)
    spans = DraftSpans(tok)
    spans.push(ids, [False] * (len(ids) - 1) + [True])
    full = tok.decode(ids)
    last = tok.decode(ids[-1:])
    runs = spans.segments(len(full) - len(last), last)
    assert runs == [(last, True)]


# ---------------------------------------------------------------------------- metrics
def test_metrics_from_steps():
    m = ServerMetrics(max_depth=3)
    m.observe_steps([Step([5, 6, 7], 2, proposed=4), Step([8], 0, proposed=4), Step([9], 0)])
    text = m.render().decode()
    assert "eagle3:spec_decode_num_drafts_total 2.0" in text
    assert "eagle3:spec_decode_num_draft_tokens_total 8.0" in text
    assert "eagle3:spec_decode_num_accepted_tokens_total 2.0" in text
    assert 'eagle3:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 1.0' in text
    assert 'eagle3:spec_decode_num_accepted_tokens_per_pos_total{position="3"} 0.0' in text
    assert "eagle3:spec_decode_acceptance_length_sum 4.0" in text


def test_metrics_count_suffix_accepts_and_steps_by_arm():
    m = ServerMetrics(max_depth=3)
    m.observe_steps([Step([5, 6, 7], 2, proposed=4, accepted_suffix=1, arm="tree4x5n8s8"),
                     Step([8, 9], 1, proposed=3, accepted_suffix=1, arm="suffix"),
                     Step([1], 0, arm="plain"), Step([2], 0, arm="plain")])
    text = m.render().decode()
    assert "eagle3:spec_decode_num_accepted_suffix_tokens_total 2.0" in text
    assert "eagle3:spec_decode_num_accepted_tokens_total 3.0" in text
    assert 'eagle3:spec_decode_steps_total{arm="plain"} 2.0' in text
    assert 'eagle3:spec_decode_steps_total{arm="suffix"} 1.0' in text
    assert 'eagle3:spec_decode_steps_total{arm="tree4x5n8s8"} 1.0' in text


# ---------------------------------------------------------------------------- the queue
class CountingScheduler(Scheduler):
    """One request at a time, a one-token chunk per 10 ms step; records how many it produced."""

    def __init__(self):
        super().__init__(1, tokenizer(), (), max_model_len=1000)
        self.produced = 0

    def step(self):
        if not self.running:
            if not self.waiting:
                return []
            self.running = [self.waiting.popleft()]
        time.sleep(0.01)
        self.produced += 1
        req = self.running[0]
        return [Emitted(req, req.output.push(Step([100 + self.produced], 0)))]

    def _drop(self, req):
        self.running.remove(req)


def test_worker_cancel_stops_between_chunks_and_full_queue_refuses():
    async def scenario():
        scheduler = CountingScheduler()
        worker = EngineWorker(scheduler, max_queue=1)
        await worker.start()
        loop = asyncio.get_running_loop()
        first = Job([1], SamplingParams(max_new_tokens=100), loop)
        worker.submit(first)
        assert isinstance(await first.out.get(), Chunk)
        worker.submit(Job([1], SamplingParams(), loop))          # waits: the engine is busy
        with pytest.raises(QueueFull):
            worker.submit(Job([1], SamplingParams(), loop))
        first.cancel()
        items = [await first.out.get()]
        while items[-1] is not END:
            items.append(await first.out.get())
        produced = scheduler.produced
        await worker.stop()
        return produced

    produced = asyncio.run(scenario())
    assert produced < 10                        # stopped within a step, not after 100 chunks


# ---------------------------------------------------------------------------- cli
@pytest.mark.parametrize("module", ["uvicorn", "fastapi"])
def test_serve_without_the_extra_names_it(monkeypatch, caplog, module):
    """An install without the serve extra died with a raw ModuleNotFoundError traceback (after
    loading the model): now one line naming the extra, before the load."""
    import eagle3.api
    from eagle3.cli import main
    loads = []
    monkeypatch.setattr(eagle3.api, "load_engine", lambda **kw: loads.append(kw))
    monkeypatch.setitem(sys.modules, module, None)        # `import module` -> ModuleNotFoundError
    with caplog.at_level(logging.ERROR):
        assert main(["serve", "--port", "9"]) == 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None
    message = errors[0].getMessage()
    assert "pip install 'eagle3[serve]'" in message and module in message and "\n" not in message
    assert loads == []
