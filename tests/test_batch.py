"""Continuous batching, the top half: the schedulers and the batched server path
(test_batch_forward.py: the slotted cache and the batched forward below them)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from eagle3.runtime.target import build_target

from spec_helpers import tiny_target


# ---------------------------------------------------------------------------- the scheduler
CTX = 160


@pytest.fixture(scope="module")
def served_target():
    """The tiny served target (real tokenizer's vocabulary) in the row-stable bf16 layout."""
    from serve_fixtures import tiny_target as served
    return build_target(served(), torch.bfloat16, row_stable=True)


@pytest.fixture(scope="module")
def alone(served_target):
    from eagle3.generate import Engine
    from serve_fixtures import tokenizer
    return Engine(served_target, tokenizer(), max_model_len=CTX)


def scheduler(engine, **kw):
    from eagle3.generate.batch import BatchScheduler
    return BatchScheduler.from_engine(engine, **kw)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def drain(sched, steps_before: int = 10_000, on_step=None) -> dict:
    """Step until idle; {request id: [chunks]} (on_step(step number, emitted) may intervene)."""
    chunks: dict = {}
    for n in range(steps_before):
        if not sched.has_work:
            break
        assert len(sched.running) <= sched.max_batch
        emitted = sched.step()
        for e in emitted:
            chunks.setdefault(e.request.id, []).append(e.chunk)
        if on_step is not None:
            on_step(n, emitted)
    return chunks


def check_equals_alone(alone, req, chunks) -> None:
    want = alone.generate(prompt_ids=req.prompt_ids, params=req.params)
    result = chunks[-1].result
    assert result is not None and chunks[-1].finish_reason == want.finish_reason
    assert result.token_ids == want.token_ids and [t for c in chunks for t in c.token_ids] == want.token_ids
    assert result.text == want.text and "".join(c.text for c in chunks) == want.text


def test_each_request_in_a_batch_equals_its_output_alone(alone, one_thread):
    """Mixed prompt lengths (one chunked), greedy and seeded sampling, stop strings and max
    tokens; more requests than slots, so requests join as others finish."""
    from eagle3.generate import SamplingParams
    stop_text = alone.generate(prompt_ids=prompt(7, 5), params=SamplingParams(max_new_tokens=12)).text
    params = [SamplingParams(max_new_tokens=9),
              SamplingParams(temperature=1.0, seed=7, max_new_tokens=14),
              SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=3, max_new_tokens=6),
              SamplingParams(max_new_tokens=12, stop=(stop_text[4:7],)),
              SamplingParams(temperature=1.0, seed=11, max_new_tokens=11, ignore_eos=True)]
    lengths = [3, 40, 12, 7, 1]
    sched = scheduler(alone, max_batch=3, prefill_chunk=16)
    reqs = [sched.add(prompt(n, seed=i if i != 3 else 5), p) for i, (n, p) in enumerate(zip(lengths, params))]
    chunks = drain(sched)
    assert sched.cache.num_free == 3
    for req in reqs:
        check_equals_alone(alone, req, chunks[req.id])
    assert chunks[reqs[3].id][-1].finish_reason == "stop"


def test_a_prompt_that_starts_like_an_earlier_one_prefills_only_the_rest(alone, one_thread):
    """The prefix cache: a later prompt sharing 20 tokens with an earlier one takes their k/v by
    copy and prefills the rest (its first forward has only those rows); one that shares fewer than
    PREFIX_MIN tokens, or the whole prompt but its last token, is handled as its own. Every output
    equals the request alone (greedy and seeded sampling). The budget drops the oldest prompts."""
    from eagle3.generate import SamplingParams
    from eagle3.generate.batch import PREFIX_MIN
    shared = prompt(20, seed=40)
    first_prompt = shared + prompt(9, seed=41)
    sched = scheduler(alone, max_batch=3, prefill_chunk=64, prefix_cache_tokens=64)
    first = sched.add(first_prompt, SamplingParams(max_new_tokens=5))
    chunks = drain(sched)
    assert first.output.cached_tokens == 0 and len(sched.prefixes.entries) == 1
    later = [sched.add(shared + prompt(6, seed=42), SamplingParams(max_new_tokens=7)),
             sched.add(shared + prompt(4, seed=43), SamplingParams(temperature=1.0, seed=3, max_new_tokens=7)),
             sched.add(shared[:PREFIX_MIN - 1] + prompt(5, seed=44), SamplingParams(max_new_tokens=4))]
    rows = []
    real = sched.target.forward_rows
    sched.target.forward_rows = lambda ids, plan, cache, *a, **kw: (rows.append(int(ids.numel())),
                                                                    real(ids, plan, cache, *a, **kw))[1]
    try:
        chunks.update(drain(sched))
    finally:
        del sched.target.forward_rows
    assert [r.output.cached_tokens for r in later] == [20, 20, 0]
    assert rows[0] == 6 + 4 + PREFIX_MIN - 1 + 5          # the first forward: only the new tokens
    for req in [first] + later:
        check_equals_alone(alone, req, chunks[req.id])
    # 29 + 26 + 24 (+ 12) tokens stored > 64: the oldest prompt went
    assert sched.prefixes.tokens <= 64 and tuple(first_prompt) not in sched.prefixes.entries
    again = sched.add(list(later[1].prompt_ids), SamplingParams(max_new_tokens=3))  # a repeat
    chunks.update(drain(sched))
    assert again.output.cached_tokens == len(later[1].prompt_ids) - 1          # all but its last token
    check_equals_alone(alone, again, chunks[again.id])


def test_cancel_mid_batch_frees_the_slot_at_once(alone, one_thread):
    from eagle3.generate import SamplingParams
    sched = scheduler(alone, max_batch=2)
    a, b, c = (sched.add(prompt(5, seed=i), SamplingParams(max_new_tokens=8)) for i in range(3))

    def cancel_b(n, emitted):
        if n == 2:
            assert b.slot is not None and sched.cache.num_free == 0 and c in sched.waiting
            sched.cancel(b)
            assert b.slot is None and sched.cache.num_free == 1 and b not in sched.running

    chunks = drain(sched, on_step=cancel_b)
    assert len(chunks[b.id]) == 3 and chunks[b.id][-1].result is None and b.output.finish == "cancelled"
    for req in (a, c):
        check_equals_alone(alone, req, chunks[req.id])
    assert sched.cache.num_free == 2


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(alone, one_thread):
    """Two requests decoding; a 70-token prompt joins: over its 5 prefill steps (16 tokens each)
    both decoders still get a token every step; its first token comes with the last chunk."""
    from eagle3.generate import SamplingParams
    sched = scheduler(alone, max_batch=3, prefill_chunk=16)
    a, b = (sched.add(prompt(4, seed=i), SamplingParams(max_new_tokens=30, ignore_eos=True))
            for i in range(2))
    chunks: dict = {}

    def step() -> set:
        emitted = sched.step()
        for e in emitted:
            chunks.setdefault(e.request.id, []).append(e.chunk)
        return {e.request.id for e in emitted}

    step()                                        # both prompts in one forward
    long = sched.add(prompt(70, seed=9), SamplingParams(max_new_tokens=5))
    fed = []
    for _ in range(4):
        assert step() == {a.id, b.id}             # the decoders' tokens keep coming
        fed.append(long.fed)
    assert fed == [16, 32, 48, 64]
    assert step() == {a.id, b.id, long.id} and long.fed == 70
    while sched.has_work:
        step()
    for req in (a, b, long):
        check_equals_alone(alone, req, chunks[req.id])


def test_the_serial_scheduler_runs_one_request_at_a_time(alone, one_thread):
    """The scheduler interface over an Engine alone: requests run in arrival order, one at a time,
    each equal to its output alone; a cancelled one makes room for the next at once."""
    from eagle3.generate import SamplingParams, SerialScheduler
    sched = SerialScheduler(alone)
    params = [SamplingParams(max_new_tokens=6), SamplingParams(temperature=1.0, seed=2, max_new_tokens=5),
              SamplingParams(max_new_tokens=7)]
    reqs = [sched.add(prompt(4 + i, seed=20 + i), p) for i, p in enumerate(params)]
    order = []
    chunks = drain(sched, on_step=lambda n, emitted: order.extend(e.request.id for e in emitted))
    assert order == sorted(order)
    for req in reqs:
        check_equals_alone(alone, req, chunks[req.id])
    a, b = (sched.add(prompt(5, seed=30 + i), SamplingParams(max_new_tokens=8)) for i in range(2))
    sched.step()
    sched.cancel(a)
    assert a.output.finish == "cancelled" and not sched.running and sched.free_slots == 1
    assert [e.request for e in sched.step()] == [b] and sched.running == [b]


# ---------------------------------------------------------------------------- the server
class SlowTarget:
    """A target whose batched forward sleeps first (requests stay in the batch long enough)."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def forward_rows(self, *args):
        time.sleep(self.delay_s)
        return self.inner.forward_rows(*args)


def batched_app(target, max_batch: int, max_queue: int = 64, delay_s: float = 0.0,
                name: str = "tiny"):
    from eagle3.generate import Engine
    from eagle3.serve import create_app
    from serve_fixtures import tokenizer
    served = SlowTarget(target, delay_s) if delay_s else target
    return create_app(Engine(served, tokenizer(), max_model_len=CTX), model_name=name,
                      max_queue=max_queue, max_batch=max_batch)


def gauges(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if not s.labels}


class StepLog(list):
    gather = 0


def watch_steps(worker, gather: int = 0) -> StepLog:
    """Record how many requests each scheduler step runs. With gather > 0, the next step waits
    (up to 30 s) until that many requests are running or queued, so that concurrent requests
    meet in one batch however the client threads are timed; set the list's `gather` attribute
    to arm it again."""
    import time
    seen = StepLog()
    seen.gather = gather
    step = worker.scheduler.step

    def watched():
        if seen.gather:
            deadline = time.monotonic() + 30
            sched = worker.scheduler            # running, admitted but not yet running, queued
            while (len(sched.running) + len(sched.waiting) + worker.waiting < seen.gather
                   and time.monotonic() < deadline):
                time.sleep(0.002)
            seen.gather = 0
        seen.append(len(worker.scheduler.running))
        return step()
    worker.scheduler.step = watched
    return seen


def test_served_concurrent_requests_each_get_their_own_output(served_target, alone):
    """Six concurrent requests (chat and completions, streamed and not, greedy and seeded) on
    --max-batch 3: each answer equals the engine's output alone, and requests shared steps."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from eagle3.generate import SamplingParams
    from eagle3.generate.batch import BatchScheduler
    from serve_fixtures import RunningServer
    cases = [(f"Question {i}: say something about {i * 7}." + " more" * (i * 9), i % 2 == 0,
              SamplingParams(temperature=0.0 if i % 3 else 0.9, seed=i, max_new_tokens=10 + 3 * i))
             for i in range(6)]
    refs = [alone.generate(messages=[{"role": "user", "content": text}], params=p).text
            for text, _, p in cases]
    app = batched_app(served_target, max_batch=3)
    worker = app.state.server.worker
    assert isinstance(worker.scheduler, BatchScheduler)
    running_seen = watch_steps(worker, gather=len(cases))

    def ask(case) -> str:
        text, stream, p = case
        kw = dict(model="tiny", messages=[{"role": "user", "content": text}], stream=stream,
                  max_tokens=p.max_new_tokens, temperature=p.temperature, seed=p.seed)
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw)
                       if c.choices)

    with RunningServer(app) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        with ThreadPoolExecutor(len(cases)) as pool:
            answers = list(pool.map(ask, cases))
        g = gauges(s.url)
    assert answers == refs
    assert max(running_seen) == 3                     # requests were decoded together
    assert g["eagle3:num_requests_running"] == 0 and g["eagle3:num_requests_waiting"] == 0


def test_a_speculative_server_batches_and_speculates_for_a_request_alone(served_target, alone):
    """A server with a draft and --max-batch 3: one greedy request alone is decoded speculatively
    (its usage counts drafted tokens), then four at once share batch steps; every answer equals
    plain decoding alone."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from eagle3.generate import SamplingParams
    from eagle3.generate.batch import BatchScheduler
    from eagle3.serve import create_app
    from serve_fixtures import GroupedEngine, RunningServer, tokenizer
    engine = GroupedEngine(served_target, tokenizer(), max_model_len=CTX)
    app = create_app(engine, model_name="tiny", max_batch=3)
    worker = app.state.server.worker
    assert isinstance(worker.scheduler, BatchScheduler) and worker.scheduler.solo is engine
    running_seen = watch_steps(worker)
    texts = [f"Tell me about {i * 13} and more." for i in range(5)]
    temps = [0.0, 0.0, 0.8, 0.0, 0.0]
    refs = [alone.generate(messages=[{"role": "user", "content": t}],
                           params=SamplingParams(temperature=temp, seed=i, max_new_tokens=12)).text
            for i, (t, temp) in enumerate(zip(texts, temps))]

    def ask(i: int) -> dict:
        body = {"model": "tiny", "messages": [{"role": "user", "content": texts[i]}], "max_tokens": 12,
                "temperature": temps[i], "seed": i}
        return httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60).json()

    with RunningServer(app) as s:
        first = ask(0)
        assert max(running_seen) == 1
        running_seen.gather = 4
        with ThreadPoolExecutor(4) as pool:
            rest = list(pool.map(ask, range(1, 5)))
    answers = [r["choices"][0]["message"]["content"] for r in [first] + rest]
    assert answers == refs
    assert first["eagle3"]["drafted_tokens"] > 0 and first["eagle3"]["draft_tokens_proposed"] > 0   # alone: speculative
    assert max(running_seen) == 3


def test_served_batch_gauges_queue_full_and_cancel(served_target):
    """max_batch 2, max_queue 1: two streams run, a third waits (the gauges say so), a fourth gets
    503; closing a stream frees its slot and the waiting request is served."""
    import httpx

    from serve_fixtures import RunningServer, wait_for
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    app = batched_app(served_target, max_batch=2, max_queue=1, delay_s=0.05)
    with RunningServer(app) as s:
        streams = []
        for _ in range(2):
            http = httpx.Client(timeout=30)
            resp = http.send(http.build_request("POST", s.url + "/v1/chat/completions",
                                                json={**body, "max_tokens": 120, "stream": True}),
                             stream=True)
            lines = resp.iter_lines()
            assert next(ln for ln in lines if ln.startswith("data:"))
            streams.append((http, resp, lines))
        # a stream's first chunk can precede its admission to a slot: wait for the gauge
        assert wait_for(lambda: gauges(s.url)["eagle3:num_requests_running"] == 2, 10.0)
        queued = {}
        t = threading.Thread(target=lambda: queued.setdefault("r", httpx.post(
            s.url + "/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=60)))
        t.start()
        assert wait_for(lambda: gauges(s.url)["eagle3:num_requests_waiting"] == 1, 10.0)
        full = httpx.post(s.url + "/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=30)
        assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
        assert int(full.headers["retry-after"]) >= 1
        http, resp, _ = streams.pop(0)
        t_close = time.perf_counter()
        resp.close()
        http.close()
        t.join(timeout=30)                            # served while the other stream runs
        assert time.perf_counter() - t_close < 3.0    # not after the 120 tokens (~6 s) it had left
        assert queued["r"].status_code == 200 and queued["r"].json()["usage"]["completion_tokens"] == 4
        assert next(ln for ln in streams[0][2] if ln.startswith("data:"))   # still streaming
        assert gauges(s.url)["eagle3:num_requests_running"] == 1
        http, resp, _ = streams.pop()
        resp.close()
        http.close()
        assert wait_for(lambda: gauges(s.url)["eagle3:num_requests_running"] == 0, 10.0)


def test_batching_is_refused_where_it_does_not_apply(served_target):
    """A target without a batched forward serves one sequence at a time and its startup line says
    why; a speculative engine batches, speculating for a greedy request that runs alone."""
    from eagle3.serve.app import batch_mode
    from serve_fixtures import GroupedEngine, tiny_target, tokenizer
    spec = GroupedEngine(served_target, tokenizer(), max_model_len=CTX)
    assert batch_mode(spec, 8)[0] == 8 and "speculative decoding for a greedy request that runs alone" \
        in batch_mode(spec, 8)[1]
    assert batch_mode(spec, 1)[0] == 1
    from eagle3.generate import Engine
    reference = Engine(tiny_target(), tokenizer(), max_model_len=CTX)      # a reference LlamaModel
    assert batch_mode(reference, 8)[0] == 1 and "no batched forward" in batch_mode(reference, 8)[1]
    assert batch_mode(Engine(served_target, tokenizer(), max_model_len=CTX), 8)[0] == 8


# ---------------------------------------------------------------------------- speculation when alone
SOLO_PROMPTS = ([5, 9, 13, 17, 21], [30, 31, 3, 4, 6, 8, 10, 12, 14, 16, 18], [7, 7, 8])
SOLO_NEW = 24


@pytest.fixture(scope="module")
def solo_engines():
    """(plain, speculative) Engines on one row-stable bf16 target; the draft is an oracle of the
    target's own greedy output for SOLO_PROMPTS[0] (most of its proposals are accepted)."""
    from eagle3.layouts import build_layouts
    from eagle3.generate import Engine, SamplingParams
    from eagle3.speculative.tree import SpecParams
    from spec_helpers import StubTokenizer, oracle_draft, tiny_draft
    model = tiny_target(seed=4)
    target, _ = build_layouts(model, tiny_draft(model), "bf16", "fp32")
    plain = Engine(target, StubTokenizer(), max_model_len=CTX)
    first = SOLO_PROMPTS[0]
    seq = first + plain.generate(prompt_ids=first, params=SamplingParams(max_new_tokens=SOLO_NEW + 8,
                                                                       ignore_eos=True)).token_ids
    spec = Engine(target, StubTokenizer(), draft=oracle_draft(model, seq), spec=SpecParams(2, 3, 6, 0.0),
                  max_model_len=CTX)
    return plain, spec


def test_a_greedy_request_alone_decodes_speculatively(solo_engines, one_thread):
    """Alone with nobody waiting: every step after the prefill is a speculative step on the solo
    engine (drafted trees, accepted tokens), and the output is plain decoding's."""
    from eagle3.generate import SamplingParams
    plain, spec = solo_engines
    sched = scheduler(spec, max_batch=3)
    req = sched.add(SOLO_PROMPTS[0], SamplingParams(max_new_tokens=SOLO_NEW, ignore_eos=True))
    chunks = drain(sched)[req.id]
    check_equals_alone(plain, req, chunks)
    steps = req.output.steps
    assert req.solo_steps == len(steps) - 1 and all(s.proposed > 0 for s in steps[1:])
    assert sum(s.accepted for s in steps) > SOLO_NEW // 3          # the oracle is mostly right
    assert len(chunks) < SOLO_NEW and any(any(c.from_draft) for c in chunks)
    assert sched.cache.num_free == 3


@pytest.mark.parametrize("join", ["copy", "refill"])
def test_a_request_that_gets_company_joins_the_batch_with_its_output(solo_engines, one_thread, join):
    """Three speculative steps alone, then two requests arrive (one greedy, one seeded sampling):
    the first leaves the solo engine and its slot takes the solo cache's k/v of its prompt and
    output so far (copy: it decodes in that same step), or, where the copy does not apply, they are
    prefilled into its slot in chunks (refill: nothing emitted meanwhile); then it decodes plainly
    with the others. Every output equals plain decoding alone; the sampled request never went solo."""
    from eagle3.generate import SamplingParams
    plain, spec = solo_engines
    sched = scheduler(spec, max_batch=3, prefill_chunk=8)
    if join == "refill":
        sched._can_copy = lambda req: False
    first = sched.add(SOLO_PROMPTS[0], SamplingParams(max_new_tokens=SOLO_NEW, ignore_eos=True))
    chunks: dict = {}
    for _ in range(4):                                    # the prefill, then 3 solo steps
        for e in sched.step():
            chunks.setdefault(e.request.id, []).append(e.chunk)
    assert first.solo_steps == 3 and first.solo is not None
    done_alone = len(first.out_ids)
    assert done_alone > 4                                 # speculation gave more than a token a step
    others = [sched.add(SOLO_PROMPTS[1], SamplingParams(max_new_tokens=10)),
              sched.add(SOLO_PROMPTS[2], SamplingParams(temperature=1.0, seed=5, max_new_tokens=12))]
    refill = len(SOLO_PROMPTS[0]) + done_alone - 1          # prompt + output but the last token
    for e in sched.step():
        chunks.setdefault(e.request.id, []).append(e.chunk)
    assert first.solo is None
    if join == "copy":
        assert first.fed == refill + 1 and len(first.out_ids) == done_alone + 1   # decoded at once
    else:
        assert first.fed == 8 and len(first.out_ids) == done_alone            # its first chunk
        while first.prefilling:
            assert len(first.out_ids) == done_alone       # nothing emitted while it refills
            for e in sched.step():
                chunks.setdefault(e.request.id, []).append(e.chunk)
        assert first.fed == refill
    for rid, cs in drain(sched).items():
        chunks.setdefault(rid, []).extend(cs)
    for req in [first] + others:
        check_equals_alone(plain, req, chunks[req.id])
    assert all(s.accepted == 0 for s in first.output.steps[4:]) and first.solo_steps == 3
    assert all(r.solo_steps == 0 for r in others)


def test_a_sampled_request_alone_is_never_solo(solo_engines, one_thread):
    """Seeded sampling decodes plainly even alone, so its output never depends on the load."""
    from eagle3.generate import SamplingParams
    plain, spec = solo_engines
    sched = scheduler(spec, max_batch=2)
    req = sched.add(SOLO_PROMPTS[1], SamplingParams(temperature=0.9, seed=3, max_new_tokens=12))
    chunks = drain(sched)[req.id]
    assert req.solo_steps == 0 and all(s.proposed == 0 for s in req.output.steps)
    check_equals_alone(plain, req, chunks)


def test_a_cancelled_solo_request_frees_its_slot(solo_engines, one_thread):
    from eagle3.generate import SamplingParams
    _, spec = solo_engines
    sched = scheduler(spec, max_batch=2)
    req = sched.add(SOLO_PROMPTS[0], SamplingParams(max_new_tokens=SOLO_NEW))
    sched.step()
    sched.step()
    assert req.solo is not None and sched.cache.num_free == 1
    sched.cancel(req)
    assert req.solo is None and sched.cache.num_free == 2 and not sched.has_work


def test_serving_bench_measures_streamed_requests(served_target):
    """`eagle3 bench serve`'s clients and statistics against the batched app in-process:
    every request streams its tokens, the figures come from the timings (2 clients x 6 tokens)."""
    import eagle3.bench.serving as bench
    from serve_fixtures import RunningServer
    prompts = ["Name a colour.", "Count to three.", "Say hello."]
    with RunningServer(batched_app(served_target, max_batch=2, name=bench.MODEL_NAME)) as s:
        timings, wall = asyncio_run(bench.run_clients(s.url, prompts, 2, 6, 1.0))
    assert [t.prompt for t in timings] == [0, 1, 2] and all(t.tokens == 6 for t in timings)
    assert all(0 < t.ttft_s <= t.e2e_s <= wall for t in timings)
    assert all(len(t.gaps_s) >= 1 for t in timings)
    r = bench.summarize(timings, wall, 2, 2, 1.0)
    assert r.tokens == 18 and r.tokens_per_s == round(18 / wall, 2) and r.requests == 3
    base = bench.Result(**{**bench.asdict(r), "max_batch": 1, "tokens_per_s": r.tokens_per_s / 2})
    assert bench.with_baseline([base, r])[1].vs_batch1 == 2.0
    spec = bench.Result(**{**bench.asdict(r), "system": "ours-eagle3", "tokens_per_s": r.tokens_per_s * 1.5})
    ratios = bench.with_baseline([base, r, spec])
    assert ratios[2].vs_plain == 1.5 and ratios[1].vs_plain is None    # over ours at the same batch
    assert bench.percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert bench.percentile([float(i) for i in range(1, 101)], 99) == 99.0
    # --rounds: each ratio within its round (a drifting machine), the summary the median of those
    rows = [bench.Result(**{**bench.asdict(r), "max_batch": 16, "clients": c, "tokens_per_s": tps,
                            "round": rnd})
            for rnd, (one, sixteen) in enumerate([(50.0, 300.0), (60.0, 300.0), (70.0, 420.0)])
            for c, tps in ((1, one), (16, sixteen))]
    summary = {m.clients: m for m in bench.medians(bench.with_baseline(rows))}
    assert summary[16].vs_one_client == 6.0 and summary[16].tokens_per_s == 300.0   # 6, 5, 6 -> 6
    assert summary[1].tokens_per_s == 60.0 and summary[1].round == -1


def asyncio_run(coro):
    import asyncio
    return asyncio.run(coro)


def test_a_batch_steps_chunks_wake_the_event_loop_once(served_target):
    """The engine thread hands a step's chunks for every running request to the event loop in one
    call (not one per chunk: ~500 cross-thread wake-ups a second at 16 clients); each job still
    gets its own chunks in order, then END."""
    import asyncio

    from eagle3.generate import Engine, SamplingParams
    from eagle3.generate.batch import BatchScheduler
    from eagle3.serve.queue import END, EngineWorker, Job
    from serve_fixtures import tokenizer

    class CountingLoop:         # the running loop, counting the engine thread's hand-overs
        def __init__(self, loop):
            self.loop, self.calls = loop, 0

        def call_soon_threadsafe(self, *args):
            self.calls += 1
            return self.loop.call_soon_threadsafe(*args)

    async def scenario():
        engine = Engine(served_target, tokenizer(), max_model_len=CTX)
        worker = EngineWorker(BatchScheduler.from_engine(engine, 4), 8)
        loop = CountingLoop(asyncio.get_running_loop())
        jobs = [Job([5 + i, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True), loop)
                for i in range(4)]
        with worker._wake:        # all four admitted together, before the engine thread runs
            worker.pending.extend(jobs)
        await worker.start()
        got = []
        for job in jobs:
            items = [await job.out.get()]
            while items[-1] is not END:
                items.append(await job.out.get())
            got.append(items)
        await worker.stop()
        return got, loop.calls

    got, calls = asyncio.run(scenario())
    assert all(len(items) == 7 and all(len(c.token_ids) == 1 for c in items[:-1]) for items in got)
    assert all(items[-2].finish_reason == "length" for items in got)
    assert calls <= 7, calls          # 6 steps (the last one also ends the jobs); per chunk: 28


def test_the_server_reports_prompt_tokens_from_the_prefix_cache(served_target):
    """OpenAI's usage.prompt_tokens_details.cached_tokens and /metrics' prompt_tokens_cached: a
    second prompt that repeats the first one's opening takes those tokens from the prefix cache,
    and after POST /reset_prefix_cache a third does not; with --prefix-cache-tokens 0 nothing is
    cached."""
    import httpx

    from eagle3.generate import Engine
    from eagle3.serve import create_app
    from serve_fixtures import RunningServer, tokenizer
    opening = "Here is a long shared opening about rivers, mountains and the sea. " * 2
    for budget, expect_cached in ((4096, True), (0, False)):
        app = create_app(Engine(served_target, tokenizer(), max_model_len=CTX), model_name="tiny",
                         max_batch=2, prefix_cache_tokens=budget)
        with RunningServer(app) as s:
            usage = [httpx.post(s.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": opening + end, "max_tokens": 3}).json()["usage"]
                for end in ("Name one.", "Name two.")]
            cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
            assert cached[0] == 0
            assert (cached[1] >= 16) == expect_cached and (cached[1] == 0) != expect_cached
            assert gauges(s.url)["eagle3:prompt_tokens_cached_total"] == cached[1]
            reset = httpx.post(s.url + "/reset_prefix_cache", timeout=30).json()["reset"]
            again = httpx.post(s.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": opening + "Name three.", "max_tokens": 3}).json()["usage"]
            assert reset == expect_cached and again["prompt_tokens_details"]["cached_tokens"] == 0


def test_the_server_says_when_the_prefix_cache_is_off_and_why(served_target):
    """--prefix-cache-tokens on a layout that is not row-stable is not silently dropped: the
    startup line says the cache is off and why."""
    from eagle3.generate import Engine
    from eagle3.generate.batch import BatchScheduler
    from eagle3.serve.app import prefix_cache_state
    from serve_fixtures import tiny_target as served, tokenizer
    fp32 = build_target(served(), torch.float32)
    for target, budget, said in ((served_target, 4096, "up to 4096 prompt tokens"),
                                 (served_target, 0, "off (--prefix-cache-tokens 0)"),
                                 (fp32, 4096, "off: this layout is not row-stable")):
        sched = BatchScheduler.from_engine(Engine(target, tokenizer(), max_model_len=CTX), 2,
                                           prefix_cache_tokens=budget)
        assert prefix_cache_state(sched, budget).startswith(said)
