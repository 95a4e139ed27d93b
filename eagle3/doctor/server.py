"""`eagle3 doctor --server URL`: is speculation paying off in a running SGLang, vLLM or eagle3 server?

The failure this exists for: the draft is fine on disk, the server starts, answers are correct, and
acceptance is zero for days because nothing looks at it. The doctor reads what the server says it
is (engines.LIVE: routes, settings, counters), sends a fixed set of prompts in phases (greedy chat,
greedy completion, sampled chat and completion), reads the engine's own speculation counters
before and after each phase, and gives a verdict:

| check              | fails when                                                                 |
|--------------------|----------------------------------------------------------------------------|
| server.reach/auth/ | the URL does not answer, times out, refuses the key, is not an OpenAI API, |
| api/timeout/metrics| or its metrics do not parse (endpoint.ServerError)                         |
| server.speculation | speculation is off (no counters, no draft) or configured but never ran     |
|                    | (a draftless eagle3 serve with no suffix block: a warning, not a failure)  |
| server.tau         | greedy tau <= fail_tau: (almost) nothing accepted; names the likely causes |
| server.offline     | with --draft/--model:  far below what our own probe gets on the same pair  |
| server.draft       | the draft's own steps (eagle3 serve: apart from suffix-only blocks, since  |
|                    | start) accept (almost) nothing: weights lost or random                     |
| server.sampled_    | warns: sampled requests accept far less than greedy on an engine whose     |
| acceptance         | draft proposes by argmax (slower, not broken)                              |

tau and acceptance per position mean what speculative/step.py says (tokens per verify step; share
of steps accepting >= k draft tokens). SGLang exports only its mean accept length since start (no
per-position counts), so its tau covers all traffic since the server started.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from ..errors import Eagle3Error
from ..speculative.monitor import DRAFT_FLOOR
from ..speculative.policy import DRAFT_MEASURE_STEPS
from .offline import PROBE_PROMPTS, ProbeSettings, load_draft_checked, load_target_checked, run_probe
from .endpoint import Counters, Endpoint, ServerError, ServerInfo, identify, settled_counters, snippet
from .report import Check, DoctorReport, failed, passed, warned

LIVE_CAUSES = (
    "likely causes: the algorithm flag (an EAGLE-3 draft served as EAGLE: SGLang "
    "--speculative-algorithm EAGLE, vLLM \"method\": \"eagle\"), aux hidden-state capture off (the "
    "draft gets one hidden state instead of its fused layers), layer ids off by one ('input to layer "
    "i' vs 'output of layer i': vLLM reads a lone SpecForge eagle_config list one layer early), the "
    "draft vocabulary map (d2t) missing so draft ids are read as target ids, draft weights lost "
    "(an RL weight update or a memory release that did not restore them) or never trained, or a "
    "draft trained for another target. Check the pair and the launch line: eagle3 doctor --model T "
    "--draft D --launch 'LINE'")
DRAFT_LOST = (
    "the draft's weights are lost or random: an RL weight update or a memory release that did not "
    "restore the draft, a draft never trained or not loaded. Reload the draft's trained weights and "
    "check the pair offline: eagle3 doctor --model T --draft D")
OFFLINE_CAUSES = (
    "the engine runs the draft differently from how it was trained: layer ids read in the other "
    "numbering (a SpecForge eagle_config list taken raw by vLLM runs one layer early), the wrong "
    "target revision or chat template, or a quantised target. Lint the launch line: eagle3 doctor "
    "--target T --draft D --launch 'LINE'")


@dataclass(frozen=True)
class ProbePrompt:
    text: str
    chat: bool
    temperature: float


@dataclass(frozen=True)
class Phase:
    name: str
    prompts: tuple[ProbePrompt, ...]
    greedy: bool


PHASES = (
    Phase("greedy chat", tuple(ProbePrompt(p, True, 0.0) for p in PROBE_PROMPTS), True),
    Phase("greedy completion", (ProbePrompt("The three primary colours are", False, 0.0),), True),
    Phase("sampled", (ProbePrompt("Write a haiku about the sea.", True, 0.7),
                       ProbePrompt("Once upon a time, in a small village,", False, 0.7)), False),
)


@dataclass(frozen=True)
class ServerSettings:
    max_tokens: int = 32
    seed: int = 0                 # sent with sampled requests
    timeout_s: float = 120.0      # per HTTP request
    fail_tau: float = 1.1         # tau <= this: (almost) nothing is accepted
    warn_tau: float = 1.3
    offline_share: float = 0.6    # live accepted tokens per step below this share of offline's: fail
    min_draft_steps: int = DRAFT_MEASURE_STEPS   # the draft's own steps needed to judge it ...
    draft_rounds: int = 8         # ... greedy chat rounds sent again at most to reach them
    phases: tuple[Phase, ...] = PHASES


@dataclass(frozen=True)
class LiveStats:
    """Speculation over one stretch of requests, from the engine's counters."""
    tau: Optional[float]                   # None: no verify step counted
    per_position: list[float]
    drafts: Optional[float]                # verify steps (None: the engine does not count them)
    accepted: Optional[float]
    since_start: bool = False              # a ratio engine: tau covers everything since start


@dataclass
class PhaseResult:
    phase: Phase
    tokens: int
    seconds: float
    stats: LiveStats

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        s = self.stats
        return {"phase": self.phase.name, "requests": len(self.phase.prompts), "tokens": self.tokens,
                "seconds": self.seconds, "tokens_per_s": self.tokens_per_s, "tau": s.tau,
                "acceptance_per_position": s.per_position, "verify_steps": s.drafts,
                "accepted_tokens": s.accepted, "since_start": s.since_start}


# ---------------------------------------------------------------------------- counters -> stats
def delta(before: Counters, after: Counters) -> LiveStats:
    """What happened between two readings (counter engines), or the ratio since start."""
    if before.drafts is not None and after.drafts is not None:
        steps, accepted = after.drafts - before.drafts, (after.accepted or 0) - (before.accepted or 0)
        if steps < 0 or accepted < 0:
            raise ServerError("server.metrics", f"the speculation counters went down (verify steps "
                              f"{before.drafts:g} -> {after.drafts:g}): the server restarted during "
                              "the check", "run the doctor again")
        depth = max(after.per_position, default=0)
        per_pos = [(after.per_position.get(k, 0.0) - before.per_position.get(k, 0.0)) / steps
                   if steps else 0.0 for k in range(1, depth + 1)]
        return LiveStats(1 + accepted / steps if steps else None, per_pos, steps, accepted)
    return LiveStats(after.accept_length, [], None, None, since_start=True)


def moved(before: Counters, after: Counters) -> bool:
    """Did a verify step happen in between? A ratio engine only tells whether one ever happened
    (SGLang has no mean accept length before its first)."""
    if before.drafts is not None and after.drafts is not None:
        return after.drafts > before.drafts
    return after.accept_length is not None


def merged(results: Sequence[PhaseResult]) -> LiveStats:
    """Several phases' stats as one (counter engines sum; ratio engines keep the latest)."""
    stats = [r.stats for r in results]
    if any(s.drafts is None for s in stats):
        return stats[-1]
    steps = sum(s.drafts for s in stats)
    accepted = sum(s.accepted for s in stats)
    depth = max(len(s.per_position) for s in stats)
    per_pos = [sum(s.per_position[k] * s.drafts for s in stats if k < len(s.per_position)) / steps
               if steps else 0.0 for k in range(depth)]
    return LiveStats(1 + accepted / steps if steps else None, per_pos, steps, accepted)


# ---------------------------------------------------------------------------- requests
def send(ep: Endpoint, model: str, prompt: ProbePrompt, s: ServerSettings) -> int:
    """One request; the completion tokens its usage reports."""
    body: dict[str, Any] = {"model": model, "max_tokens": s.max_tokens,
                            "temperature": prompt.temperature}
    if prompt.temperature > 0:
        body["seed"] = s.seed
    if prompt.chat:
        body["messages"] = [{"role": "user", "content": prompt.text}]
        route = "/v1/chat/completions"
    else:
        body["prompt"] = prompt.text
        route = "/v1/completions"
    reply = ep.json(route, body)
    tokens = (reply.get("usage") or {}).get("completion_tokens") if isinstance(reply, dict) else None
    if not isinstance(tokens, int) or not reply.get("choices"):
        raise ServerError("server.api", f"POST {ep.url}{route}: usage.completion_tokens and choices "
                          f"expected, found {snippet(repr(reply).encode())}",
                          "point --server at an OpenAI-compatible server")
    return tokens


def run_phase(ep: Endpoint, info: ServerInfo, model: str, phase: Phase, s: ServerSettings,
              before: Counters) -> tuple[PhaseResult, Counters]:
    tokens, start = 0, time.perf_counter()
    for prompt in phase.prompts:
        tokens += send(ep, model, prompt, s)
    seconds = time.perf_counter() - start
    after = settled_counters(ep, info)
    return PhaseResult(phase, tokens, seconds, delta(before, after)), after


# ---------------------------------------------------------------------------- the verdict
def configured(info: ServerInfo, counters: Counters) -> tuple[Optional[bool], str]:
    """(does the server say it speculates, in its own words); None when it cannot tell."""
    facts, st = info.engine, info.settings
    if facts is None:
        return None, "no speculation counters this doctor knows (it reads vLLM, SGLang and eagle3 serve)"
    if facts.name == "eagle3":
        tree = st.get("spec") or {}
        return bool(st.get("speculative")), (f"/health: speculative {st.get('speculative')}" +
                                             (f", tree {tree}" if tree else ""))
    if facts.name == "sglang":
        algo = st.get("speculative_algorithm")
        return bool(algo), (f"speculative_algorithm {algo}, draft "
                            f"{st.get('speculative_draft_model_path')}, steps/topk/draft tokens "
                            f"{st.get('speculative_num_steps')}/{st.get('speculative_eagle_topk')}/"
                            f"{st.get('speculative_num_draft_tokens')}")
    if not info.has_metrics:
        return None, "no /metrics route"
    n = len(counters.per_position)
    return counters.drafts is not None, (f"{facts.drafts} exported, {n} draft positions" if
                                         counters.drafts is not None else
                                         f"no {facts.drafts} counters on /metrics")


NOT_SPECULATING_FIX = {
    "vllm": "start vLLM with --speculative-config '{\"method\": \"eagle3\", \"model\": DRAFT, "
            "\"num_speculative_tokens\": 3}'",
    "sglang": "start SGLang with --speculative-algorithm EAGLE3 --speculative-draft-model-path DRAFT",
    "eagle3": "start eagle3 serve with --draft DRAFT (or the default draft for the default model)",
}


def speculation_check(info: ServerInfo, before: Counters, results: list[PhaseResult],
                      after: Counters) -> Check:
    is_on, how = configured(info, before)
    name = "server.speculation"
    if is_on is None:
        return failed(name, f"cannot see speculation on {info.label}: {how}",
                      "serve with vLLM, SGLang or eagle3 serve (their counters are read), or "
                      "check the pair offline: eagle3 doctor --model T --draft D")
    if not is_on:
        return failed(name, f"{info.label} is not speculating ({how})",
                      NOT_SPECULATING_FIX[info.engine.name])
    n = sum(len(r.phase.prompts) for r in results)
    if not moved(before, after):
        blocks = info.settings.get("suffix_only_tokens") if info.engine.name == "eagle3" else None
        if blocks:                  # draftless: it speculates only where the text repeats
            return warned(name, f"{info.label} speculates without a draft ({how}, suffix-only blocks "
                                f"of up to {blocks} tokens): none of the {n} requests repeated enough "
                                "text for a block, as on text with little to copy",
                          "serve a draft to speculate on any text: --draft DRAFT, or --learn DIR to "
                          "learn a first one from the server's traffic")
        return failed(name, f"speculation is configured ({how}) but no draft was verified during "
                            f"{n} requests", "check the server's log for why the draft is not run "
                            "(vLLM disables it above speculative_disable_by_batch_size; eagle3 serve "
                            "--max-batch > 1 speculates only a greedy request that runs alone)")
    return passed(name, f"{info.label} speculates ({how})")


def fmt_stats(s: LiveStats, tokens_per_s: float) -> str:
    if s.since_start:
        return (f"tau {s.tau:.2f} (the engine's mean accept length since the server started: it "
                f"exports no per-position counts); {tokens_per_s:.1f} tok/s")
    acc = ", ".join(f"{a:.2f}" for a in s.per_position)
    return (f"tau {s.tau:.2f} over {s.drafts:g} verify steps; acceptance per position [{acc}]; "
            f"{tokens_per_s:.1f} tok/s")


def causes(info: ServerInfo) -> str:
    """LIVE_CAUSES, led by what the server's own settings show."""
    algo = str(info.settings.get("speculative_algorithm") or "")
    if algo.upper() == "EAGLE":
        return ("the server runs speculative_algorithm EAGLE: an EAGLE-3 draft gets one hidden state "
                "instead of its fused layers (use --speculative-algorithm EAGLE3). Other " + LIVE_CAUSES)
    return LIVE_CAUSES


def tau_check(info: ServerInfo, greedy: list[PhaseResult], s: ServerSettings) -> Check:
    stats = merged(greedy)
    tokens = sum(r.tokens for r in greedy)
    seconds = sum(r.seconds for r in greedy)
    what = (f"{fmt_stats(stats, tokens / seconds if seconds else 0.0)} "
            f"({sum(len(r.phase.prompts) for r in greedy)} greedy requests, {tokens} tokens)")
    if stats.tau is None:
        return warned("server.tau", "no verify step counted for the greedy requests", causes(info))
    if stats.tau <= s.fail_tau:
        return failed("server.tau", f"{what}: the draft is (almost) never accepted", causes(info))
    if stats.tau < s.warn_tau:
        return warned("server.tau", f"{what}: low acceptance", causes(info))
    return passed("server.tau", what)


def sampled_check(results: list[PhaseResult]) -> list[Check]:
    out = []
    for r in results:
        if r.stats.tau is None:
            out.append(warned("server.sampled", f"{r.phase.name}: no verify step counted over "
                              f"{len(r.phase.prompts)} requests ({r.tokens_per_s:.1f} tok/s)",
                              "this server does not speculate sampled requests (eagle3 serve "
                              "--max-batch > 1 speculates greedy requests only)"))
        elif not r.stats.since_start:
            out.append(passed("server.sampled", f"{r.phase.name}: {fmt_stats(r.stats, r.tokens_per_s)}"))
    return out


def draft_check(info: ServerInfo, counters: Counters, s: ServerSettings,
                health: Optional[dict] = None) -> list[Check]:
    """The draft's own acceptance, apart from suffix-only blocks: an adaptive server stops asking a
    useless draft, so its overall tau alone looks healthy. Fails when the draft accepted fewer than
    DRAFT_FLOOR tokens a step over at least min_draft_steps of its own steps since start (greedy
    chat rounds are sent again, up to draft_rounds, until the server has counted that many), or
    when the server says its latest own steps collapsed (weights lost mid-run).
    `health`: the server's /health "draft" after the requests, where it has one."""
    if counters.draft_steps is None:
        return []
    draft = health if isinstance(health, dict) else info.info.get("draft")
    name = draft.get("name") if isinstance(draft, dict) else None
    who = f"the draft {name}" if name else "the draft"
    steps, accepted = counters.draft_steps, counters.draft_accepted or 0.0
    if steps < s.min_draft_steps:
        return [warned("server.draft", f"{who} verified its own proposals in {steps:g} steps since "
                       "the server started: too few to judge it", "send more greedy requests, then "
                       "run the doctor again")]
    tau = 1 + accepted / steps
    what = (f"{who}: tau {tau:.2f} over {steps:g} steps of its own proposals since the server started "
            f"({accepted:g} accepted tokens; suffix-only blocks excluded)")
    if accepted < DRAFT_FLOOR * steps:
        return [Check("server.draft", "fail", f"{what}: the draft is (almost) never accepted", DRAFT_LOST,
                      field="draft tau", found=round(tau, 2), expected=f">= {1 + DRAFT_FLOOR}")]
    if isinstance(draft, dict) and draft.get("collapsed"):
        return [Check("server.draft", "fail", f"{what}, but its latest own steps accept (almost) "
                      "nothing: the server reports the draft collapsed", DRAFT_LOST,
                      field="draft collapsed", found=True, expected=False)]
    return [passed("server.draft", what)]


def argmax_check(info: ServerInfo, greedy: LiveStats, sampled: list[PhaseResult]) -> list[Check]:
    """Slower, not broken: an engine whose draft proposes by argmax loses most of its acceptance on
    sampled requests."""
    if info.engine is None or not info.engine.argmax_draft or greedy.tau is None or not sampled:
        return []
    stats = merged(sampled)
    if stats.tau is None or stats.since_start or greedy.tau - 1 < 0.2:
        return []
    what = f"sampled tau {stats.tau:.2f} vs greedy {greedy.tau:.2f}"
    if stats.tau - 1 < 0.5 * (greedy.tau - 1):
        return [Check("server.sampled_acceptance", "warn", f"{what}: {info.label} drafts by argmax, so "
                      "sampled requests accept far less (slower, not broken)",
                      "expect less from speculation at temperature > 0; lower num_speculative_tokens "
                      "for sampled traffic, or measure it with and without speculation",
                      field="sampled tau", found=round(stats.tau, 2), expected=f"near {greedy.tau:.2f}")]
    return [passed("server.sampled_acceptance", what)]


# ---------------------------------------------------------------------------- offline comparison
def server_tree(info: ServerInfo, counters: Counters) -> Optional[tuple[int, int, int]]:
    """(top_k, depth, num_draft_tokens) the server drafts with, where it says."""
    st, name = info.settings, info.engine.name if info.engine else None
    try:
        if name == "eagle3" and st.get("spec"):
            t = st["spec"]
            return int(t["top_k"]), int(t["depth"]), int(t["num_draft_tokens"])
        if name == "sglang" and st.get("speculative_num_steps"):
            return (int(st["speculative_eagle_topk"]), int(st["speculative_num_steps"]),
                    int(st["speculative_num_draft_tokens"]))
    except (KeyError, TypeError, ValueError):
        return None
    if name == "vllm" and counters.per_position:          # a chain of num_speculative_tokens
        n = len(counters.per_position)
        return 1, n, n + 1
    return None


def offline_checks(report: DoctorReport, target: Any, draft: Optional[str], phase: PhaseResult,
                   tree: Optional[tuple[int, int, int]], s: ServerSettings) -> None:
    """Our probe on the same pair and prompts; fail when the server accepts far less."""
    pair = load_target_checked(target, report)
    if pair.target is None:
        return
    load_draft_checked(pair, draft, None, report)
    if pair.draft is None:
        return
    probe = ProbeSettings(prompts=tuple(p.text for p in phase.phase.prompts), max_new_tokens=s.max_tokens,
                          try_shifted_ids=False)
    if tree is not None:
        probe = replace(probe, top_k=tree[0], depth=tree[1], num_draft_tokens=tree[2])
    try:
        offline = run_probe(pair, pair.draft, probe, plain=False)
    except Eagle3Error as e:
        report.checks.append(warned("server.offline", f"offline probe did not run: {e}",
                                    "check the pair alone: eagle3 doctor --model T --draft D"))
        return
    live = phase.stats.tau
    shape = f"tree top_k {probe.top_k}, depth {probe.depth}, {probe.num_draft_tokens} tokens"
    report.probe["offline"] = {"tau": offline.tau, "acceptance_per_position":
                               offline.acceptance_per_position, "tree": list(tree or ())}
    what = (f"{phase.phase.name}: server tau {live:.2f}, offline probe tau {offline.tau:.2f} "
            f"({shape}{'' if tree else ': the server does not say its tree'})")
    if phase.stats.since_start:
        what += "; the server's figure covers all traffic since it started"
    if offline.tau - 1 > 0.2 and live - 1 < s.offline_share * (offline.tau - 1):
        report.checks.append(failed("server.offline", f"{what}: acceptance is far below what the "
                                    "same pair gives offline", OFFLINE_CAUSES))
    else:
        report.checks.append(passed("server.offline", what))


# ---------------------------------------------------------------------------- entry point
def run_server_doctor(url: str, api_key: Optional[str] = None, model: Optional[str] = None,
                      target: Any = None, draft: Optional[str] = None, offline: bool = False,
                      settings: ServerSettings = ServerSettings()) -> DoctorReport:
    """Check a running server's speculation; never raises for a server it cannot read (a failed
    check names what happened and the fix). offline: also run our probe on target + draft."""
    report = DoctorReport()
    ep = Endpoint(url, api_key, settings.timeout_s)
    try:
        measured = measure(ep, model, settings, report)
    except ServerError as e:
        report.checks.append(failed(e.check, e.message, e.fix))
        return report
    chat = [r for r in measured.results if r.phase is settings.phases[0]]
    if offline and measured.speculating and chat and chat[0].stats.tau is not None:
        offline_checks(report, target, draft, chat[0], measured.tree, settings)
    return report


def final_draft_health(ep: Endpoint, info: ServerInfo) -> Optional[dict]:
    """eagle3 serve's /health "draft" now (the draft's own acceptance after the requests)."""
    if info.engine is None or info.engine.draft_steps is None or not info.info_route:
        return None
    body = ep.json(info.info_route, optional=True)
    return body.get("draft") if isinstance(body, dict) else None


@dataclass
class Measured:
    results: list[PhaseResult]
    tree: Optional[tuple[int, int, int]]     # the server's draft tree, where it says
    speculating: bool


def measure(ep: Endpoint, model: Optional[str], s: ServerSettings, report: DoctorReport) -> Measured:
    info = identify(ep)
    report.checks.append(passed("server.reach", f"{ep.url} serves {info.models}"))
    served = model or (info.models[0] if info.models else None)
    if served is None:
        raise ServerError("server.api", f"{ep.url}/v1/models lists no model", "pass --served-model-name NAME")
    engine = (f"{info.label}" + (f" ({info.info_route})" if info.info_route else "") +
              ("" if info.has_metrics else "; no /metrics" +
               (f" (SGLang: {info.engine.metrics_flag})" if info.engine and
                info.engine.metrics_flag else "")))
    report.checks.append(passed("server.engine", engine) if info.engine else
                         warned("server.engine", engine, "the doctor reads vLLM, SGLang and eagle3 "
                                "serve; other engines' counters are unknown to it"))
    first = counters = settled_counters(ep, info)
    results = []
    for phase in s.phases:
        result, counters = run_phase(ep, info, served, phase, s, counters)
        results.append(result)
    for _ in range(s.draft_rounds):               # an adaptive server asks its draft now and then
        if counters.draft_steps is None or counters.draft_steps >= s.min_draft_steps:
            break
        _, counters = run_phase(ep, info, served, s.phases[0], s, counters)
    report.facts.update(server=ep.url, engine=info.engine.name if info.engine else None,
                        version=info.version, model=served, settings=info.settings)
    report.probe = {"phases": [r.as_dict() for r in results]}
    spec = speculation_check(info, first, results, counters)
    report.checks.append(spec)
    measured = Measured(results, server_tree(info, first), spec.status == "pass")
    if measured.speculating:
        greedy = [r for r in results if r.phase.greedy]
        report.checks.append(tau_check(info, greedy, s))
        report.checks += draft_check(info, counters, s, final_draft_health(ep, info))
        report.checks += sampled_check([r for r in results if not r.phase.greedy])
        if greedy:
            report.checks += argmax_check(info, merged(greedy),
                                          [r for r in results if not r.phase.greedy])
    return measured
