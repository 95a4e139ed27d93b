"""Prometheus metrics, one CollectorRegistry per app (names in the style of vLLM, prefix `eagle3:`).

| metric | kind | meaning |
|---|---|---|
| eagle3:requests_total{endpoint,status} | counter | finished HTTP requests to /v1/* by status code |
| eagle3:request_success_total{finish_reason} | counter | generations that ran to stop/length |
| eagle3:requests_cancelled_total | counter | generations stopped because the client went away |
| eagle3:requests_body_disconnected_total | counter | clients gone before sending the whole body (499) |
| eagle3:prompt_tokens_total, eagle3:generation_tokens_total | counter | tokens in / out |
| eagle3:prompt_tokens_cached_total | counter | prompt tokens taken from the prefix cache (--max-batch > 1) |
| eagle3:e2e_request_latency_seconds | histogram | arrival -> last token (queue wait included) |
| eagle3:time_to_first_token_seconds | histogram | arrival -> first token (queue wait included) |
| eagle3:num_requests_waiting, eagle3:num_requests_running | gauge | queue depth; sequences in the engine (up to --max-batch; vLLM's vllm:num_requests_waiting/running) |
| eagle3:spec_decode_num_drafts_total | counter | decode steps that verified a draft |
| eagle3:spec_decode_num_draft_tokens_total | counter | draft tokens proposed (verified by the target) |
| eagle3:spec_decode_num_accepted_tokens_total | counter | draft tokens accepted |
| eagle3:spec_decode_num_accepted_suffix_tokens_total | counter | of those, suffix-only nodes |
| eagle3:spec_decode_steps_total{arm} | counter | decode steps by adaptive choice (policy.name_of) |
| eagle3:spec_decode_num_accepted_tokens_per_pos_total{position=k} | counter | steps accepting >= k |
| eagle3:spec_decode_acceptance_length | histogram | tokens per decode step (accepted + 1; mean = tau) |
| eagle3:spec_decode_degraded | gauge | 1 while the engine's acceptance monitor reports degraded, or the draft's own acceptance has collapsed |
| eagle3:spec_decode_draft_steps_total | counter | decode steps that verified the draft's own proposals (not suffix-only blocks) |
| eagle3:spec_decode_draft_accepted_tokens_total | counter | draft tokens the draft itself proposed and the target accepted |
| eagle3:learn_draft_version, eagle3:learn_swaps, eagle3:learn_rollbacks | gauge | `--learn`: the served draft version (DIR/drafts/vN), swaps and rollbacks since start |
| eagle3:learn_captured_tokens | gauge | `--learn`: tokens in the captured traffic shards written |
| eagle3:learn_learner_state{state} | gauge | `--learn`: 1 for the learner's state (idle, running, paused, failed, swapping: a new version loads) |
| eagle3:batch_speculation_on | gauge | `--max-batch` > 1 with a draft: 1 while the batch gate lets the batch speculate |
| eagle3:batch_gate_efficiency | gauge | the gate's rolling tokens/s of speculative steps over plain decoding's |
| eagle3:batch_gate_steps{kind} | gauge | batch steps the gate judged: on (speculative), off (plain), checks (plain, while on), probes, switches_off |

The spec_decode counters take every decode step the engine ran, cancelled requests included, like
the acceptance monitor behind /health, so the two always agree.
"""
from __future__ import annotations

from typing import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from ..speculative.monitor import is_draft_step
from ..speculative.step import Step

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, max_depth: int):
        self.registry = r = CollectorRegistry()
        self.max_depth = max_depth
        self.requests = Counter("eagle3:requests", "Finished /v1 requests by status code",
                                ["endpoint", "status"], registry=r)
        self.success = Counter("eagle3:request_success", "Completed generations by finish reason",
                               ["finish_reason"], registry=r)
        self.cancelled = Counter("eagle3:requests_cancelled",
                                 "Generations stopped because the client disconnected", registry=r)
        self.body_disconnects = Counter("eagle3:requests_body_disconnected",
                                        "Requests whose client disconnected before sending the "
                                        "whole body (answered 499, nothing logged)", registry=r)
        self.prompt_tokens = Counter("eagle3:prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_prompt_tokens = Counter("eagle3:prompt_tokens_cached",
                                            "Prompt tokens whose k/v came from the prefix cache",
                                            registry=r)
        self.generation_tokens = Counter("eagle3:generation_tokens", "Tokens generated", registry=r)
        self.latency = Histogram("eagle3:e2e_request_latency_seconds", "Arrival to last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("eagle3:time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.waiting = Gauge("eagle3:num_requests_waiting", "Requests in the queue", registry=r)
        self.running = Gauge("eagle3:num_requests_running", "Requests in the engine", registry=r)
        self._spec_metrics(r)

    def _spec_metrics(self, r: CollectorRegistry) -> None:
        self.num_drafts = Counter("eagle3:spec_decode_num_drafts",
                                  "Decode steps that verified draft tokens", registry=r)
        self.draft_tokens = Counter("eagle3:spec_decode_num_draft_tokens",
                                    "Draft tokens proposed to the target", registry=r)
        self.accepted_tokens = Counter("eagle3:spec_decode_num_accepted_tokens",
                                       "Draft tokens accepted by the target", registry=r)
        self.accepted_suffix = Counter("eagle3:spec_decode_num_accepted_suffix_tokens",
                                       "Accepted draft tokens that only the suffix index proposed",
                                       registry=r)
        self.steps_by_arm = Counter("eagle3:spec_decode_steps",
                                    "Decode steps by the adaptive step's choice", ["arm"], registry=r)
        self.accepted_per_pos = Counter("eagle3:spec_decode_num_accepted_tokens_per_pos",
                                        "Steps whose accepted draft length reached this position",
                                        ["position"], registry=r)
        buckets = tuple(float(k) for k in range(1, self.max_depth + 2))
        self.accept_len = Histogram("eagle3:spec_decode_acceptance_length",
                                    "Tokens per decode step (accepted draft tokens + 1)",
                                    buckets=buckets, registry=r)
        self.draft_steps = Counter("eagle3:spec_decode_draft_steps",
                                   "Decode steps that verified the draft's own proposals", registry=r)
        self.draft_accepted = Counter("eagle3:spec_decode_draft_accepted_tokens",
                                      "Accepted tokens the draft itself proposed", registry=r)
        self.degraded = Gauge("eagle3:spec_decode_degraded",
                              "1 while the rolling acceptance length sits at 1.0", registry=r)
        for k in range(1, self.max_depth + 1):          # export zeros before the first request
            self.accepted_per_pos.labels(position=str(k))

    def watch_queue(self, waiting: Callable[[], int], running: Callable[[], int],
                    degraded: Callable[[], bool]) -> None:
        """Gauges read at scrape time."""
        self.waiting.set_function(waiting)
        self.running.set_function(running)
        self.degraded.set_function(lambda: float(degraded()))

    def watch_learn(self, snapshot: Callable[[], dict]) -> None:
        """Learning gauges (`--learn`), read from the controller's snapshot at scrape time."""
        r = self.registry
        for key, doc in (("draft_version", "Served draft version (DIR/drafts/vN)"),
                         ("swaps", "Draft swaps since start"), ("rollbacks", "Draft rollbacks since start"),
                         ("captured_tokens", "Tokens in the captured traffic written")):
            Gauge(f"eagle3:learn_{key}", doc, registry=r).set_function(lambda k=key: float(snapshot()[k]))
        state = Gauge("eagle3:learn_learner_state", "1 for the learner's state", ["state"], registry=r)
        for name in ("idle", "running", "paused", "failed"):
            state.labels(state=name).set_function(lambda n=name: float(snapshot()["learner_state"] == n))

    def watch_gate(self, summary: Callable[[], dict]) -> None:
        """The batch gate's state (speculative.gate.BatchGate.summary), read at scrape time."""
        r = self.registry
        Gauge("eagle3:batch_speculation_on", "1 while the batch speculates",
              registry=r).set_function(lambda: float(summary()["speculating"]))
        Gauge("eagle3:batch_gate_efficiency", "Speculative steps' tokens/s over plain decoding's",
              registry=r).set_function(lambda: float(summary()["efficiency"]))
        steps = Gauge("eagle3:batch_gate_steps", "Batch steps the gate judged, by kind", ["kind"], registry=r)
        for kind in ("on", "off", "checks", "probes", "switches_off"):
            steps.labels(kind=kind).set_function(lambda k=kind: float(summary()[k]))

    def observe_steps(self, decode_steps: Sequence[Step]) -> None:
        """Speculation counters from decode steps (prefill excluded), finished or cancelled."""
        for s in decode_steps:                 # per step, so the engine thread does O(accepted) work
            if s.arm:
                self.steps_by_arm.labels(arm=s.arm).inc()
            if s.proposed <= 0:
                continue
            self.num_drafts.inc()
            self.draft_tokens.inc(s.proposed)
            self.accepted_tokens.inc(s.accepted)
            self.accepted_suffix.inc(s.accepted_suffix)
            if is_draft_step(s):
                self.draft_steps.inc()
                self.draft_accepted.inc(s.accepted - s.accepted_suffix)
            self.accept_len.observe(s.accepted + 1)
            for k in range(1, s.accepted + 1):  # acceptance_stats' per-position rule, as counters
                self.accepted_per_pos.labels(position=str(k)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
