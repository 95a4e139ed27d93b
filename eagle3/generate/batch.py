"""Continuous batching of plain decoding: several requests decoded together, one target forward per
step over all of their rows (InferenceTarget.forward_rows on a SlotCache, a slot per sequence).

A step:  admit waiting requests into free slots (arrival order, up to max_batch running)
      -> rows: one per decoding request (its last token), then prompt chunks of the requests still
         prefilling, prefill_chunk prompt tokens at most per step (a long prompt is spread over
         several steps, so the decoding requests keep getting a token every step)
      -> one forward -> per request whose block ended its prompt or decoded: sample with its own
         SamplingParams and generator (sampling.sample_each: one call per group of rows with the
         same settings, each row's token as alone) -> its Output (output.py: eos / stop
         strings / max tokens, as alone) -> Chunk
      -> a finished request frees its slot before the next step; cancel() frees one at once.

Each request's output equals its Engine output alone (greedy and seeded sampling) where the layout
is row-stable (bf16 as load_engine builds it): every row of a forward gets the bits it gets alone.
On such a layout a prompt that starts like a recent one (the chat template's system prompt, a
conversation's earlier turns) takes those tokens' k/v from the prefix cache (PrefixStore, a copy
into its slot) and prefills only the rest.
Bookkeeping is plain Python.

Speculation inside the batch (`chain_costs`, on a row-stable layout; chains.py): a decoding
request's block may be its last token and a chain of tokens its suffix index guesses (the prompt
and output so far), where the machine's cost of the extra rows pays for the tokens the request's
rolling acceptance expects. The forward gives logits for every row of such a block; its tokens are
sampled row by row as plain decoding samples them until one differs from the chain, and the slot
drops the rows past the accepted ones. Greedy and seeded outputs stay plain decoding's. With an
EAGLE-3 draft a request may instead append its draft's top-1 tokens; the requests' drafts share
one slotted draft cache and are drafted together (chains.DraftPool: a forward a level over every
chain's rows), and the planner charges a chain what its rows add to those forwards.

Speculation when alone (`solo`, an Engine with a draft on the same target): a greedy request that is
admitted to an empty batch with nobody waiting decodes speculatively on that Engine's own caches (an
Engine RequestRun: its SpecDecoder and adaptive policy, emitting through the request's Output). When
another request arrives it is preempted after its current step and joins the batch: its slot takes
the solo cache's k/v of its prompt and output so far (a copy, no forward; on a layout that is not
row-stable they are prefilled into the slot in chunks, without emitting), and it decodes plainly
with the others from its last token on. A greedy output is the same either way (speculation is
lossless, the layout row-stable); sampled requests never go solo, so a seeded output never depends
on the load. One request decodes alone on the solo engine at most; the batch never waits for
speculation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..errors import InputError
from ..models.kv_cache import PrefixStore
from ..sampling import SamplingParams, sample_each
from ..runtime.costs import LiveCosts
from ..speculative.decoder import check_draft
from ..speculative.gate import BatchGate
from ..speculative.policy import DRAFT_PROBE_EVERY, draft_interval
from ..speculative.step import Step
from .chains import (DRAFT_MAX_TOKENS, NO_EXTRA, ChainPlanner, ChainState, DraftChain, DraftPool, DraftSpend,
                     Guess, Option, check_tree, expected_tokens, ranked_nodes, worth_asking)
from .engine import RequestRun
from .output import Output
from .scheduler import Emitted, Request, Scheduler

DEFAULT_MAX_BATCH = 8       # a few rows more per forward cost little next to one row (bf16 kernels)
PREFILL_CHUNK = 64          # prompt tokens per step, over all prefilling requests
PREFIX_CACHE_TOKENS = 4096  # prompt tokens whose k/v are kept for later prompts (0: off)
PREFIX_MIN = 8              # shorter shared prefixes are prefilled (a copy saves too little)


@dataclass(eq=False)
class BatchRequest(Request):
    """One request's state in the scheduler (read-only outside it)."""
    gen: Optional[torch.Generator] = None       # its sampling generator
    slot: Optional[int] = None
    fed: int = 0                    # tokens (prompt, then output) whose k/v are in the slot
    solo: Optional[RequestRun] = None      # its RequestRun on the solo engine while it decodes alone
    solo_steps: int = 0             # decode steps it ran speculatively alone
    prefix_seen: bool = False       # looked up in the prefix cache (once, before its prefill)
    chain: Optional[ChainState] = None   # its suffix index and chain acceptance (chains on)

    @property
    def out_ids(self) -> list[int]:
        return self.output.ids

    @property
    def context_len(self) -> int:
        """Tokens whose k/v must be in the slot before the next decode row (its last output token,
        or the prompt's last token before the first output)."""
        return len(self.prompt_ids) + max(len(self.out_ids) - 1, 0)

    @property
    def prefilling(self) -> bool:
        return self.fed < self.context_len

    def context(self, start: int, count: int) -> list[int]:
        """Tokens start.. (at most count) of the prompt followed by the output, below context_len."""
        end = min(start + count, self.context_len)
        n = len(self.prompt_ids)
        return (self.prompt_ids[start:min(end, n)] + self.out_ids[max(start - n, 0):max(end - n, 0)])


class BatchScheduler(Scheduler):
    def __init__(self, target, tokenizer, eos_ids: set[int], max_batch: int = DEFAULT_MAX_BATCH,
                 max_model_len: int = 2048, prefill_chunk: int = PREFILL_CHUNK, solo=None,
                 prefix_cache_tokens: int = PREFIX_CACHE_TOKENS,
                 chain_costs: Optional[Callable[[float], float]] = None, draft=None,
                 draft_costs: Optional[Callable[[float], float]] = None, chain_rows: int = 1 << 30,
                 monitor=None, live: Optional[LiveCosts] = None):
        """target: an inference layout with forward_rows (runtime.target.InferenceTarget).
        solo: an Engine with a draft on this target, for a greedy request that runs alone.
        prefix_cache_tokens: the prefix cache's budget (models.kv_cache.PrefixStore; on a
        row-stable layout only, where a copied row equals a prefilled one bit for bit; 0: off).
        chain_costs: ms of a forward by rows (runtime.costs.CostTable.target): speculation inside
        the batch, suffix chains where they pay (chains.py; on a row-stable layout only, where a
        checked row equals the row decoded alone; None: off).
        chain_rows: no chain makes a forward longer than this (the cost table's largest block:
        past it the costs are extrapolated, and a prompt chunk's rows made chains look free).
        draft, draft_costs: an EAGLE-3 draft layout on this target and the ms of its forward by rows:
        with chains on, a request may also append a chain of the draft's top-1 tokens (chains.py
        DraftPool: a slot of one draft cache per request, fed the target's features from the
        batch's forwards, every asked chain drafted together).
        monitor: the engine's AcceptanceMonitor (speculative.monitor): it sees every draft chain
        the batch checks, as it sees the solo engine's steps (/health, /metrics).
        live: the cost table chain_costs reads, fitted to the batch's forwards as they run
        (runtime.costs.LiveCosts); with chains on, a BatchGate (speculative.gate) judges every
        step against plain decoding's predicted time and turns speculation off where it loses."""
        if max_batch < 1 or prefill_chunk < 1:
            raise InputError(f"max_batch ({max_batch}) and prefill_chunk ({prefill_chunk}) must be "
                             ">= 1")
        if not hasattr(target, "forward_rows"):
            raise InputError(f"{type(target).__name__} has no batched forward (forward_rows): "
                             "batching needs the native inference layout; use max_batch 1")
        super().__init__(max_batch, tokenizer, eos_ids, max_model_len)
        self.target, self.prefill_chunk = target, prefill_chunk
        if solo is not None and (not solo.speculative or solo.target is not target):
            raise InputError("the solo engine must be speculative (a draft) on the batch's own target")
        self.solo = solo
        self.cache = target.new_slot_cache(max_model_len, max_batch)
        # a row's k/v is the same whatever forward computed it: rows may be copied between caches
        self.row_stable = bool(getattr(getattr(target, "backend", None), "row_stable", False))
        self.prefixes = (PrefixStore(prefix_cache_tokens) if self.row_stable and prefix_cache_tokens
                         else None)
        backend = getattr(target, "backend", None)
        self.chains = (ChainPlanner(chain_costs, min(getattr(backend, "kernel_rows", 0) or 1 << 30, chain_rows))
                       if chain_costs is not None and self.row_stable else None)
        if draft is not None:             # checked where it enters, used only with chains on
            if draft.config.algorithm != "eagle3" or draft_costs is None:
                raise InputError(f"draft chains need an EAGLE-3 draft (this one: {draft.config.algorithm}) "
                                 "and draft_costs (its forward's ms by rows); pass draft=None for "
                                 "suffix chains alone")
            check_draft(draft, target, ())
        self.draft = draft if self.chains is not None else None
        self.drafts = (DraftPool(self.draft, max_model_len + DRAFT_MAX_TOKENS, max_batch)
                       if self.draft is not None else None)
        self.draft_costs = draft_costs
        self.monitor = monitor
        self.capture_ids = tuple(draft.config.aux_layer_ids) if self.draft is not None else ()
        self.live = live
        self.gate = BatchGate() if self.chains is not None and live is not None else None
        self.spec_was_on = True           # the last batch step speculated (draft chains are fed)
        self.checking = False             # ... and was the gate's plain check (no guesses)
        self.draft_quiet = 0              # batch steps since a draft chain was checked
        self.draft_checked = 0            # draft chains checked so far
        self.draft_measure = 0            # ... of which the first are asked densely (draft_interval)

    @classmethod
    def from_engine(cls, engine, max_batch: int = DEFAULT_MAX_BATCH, prefill_chunk: int = PREFILL_CHUNK,
                    prefix_cache_tokens: int = PREFIX_CACHE_TOKENS) -> "BatchScheduler":
        """A scheduler over an Engine's target, tokenizer, eos ids and context length; a speculative
        Engine also decodes a greedy request that runs alone (solo) and, with its adaptive policy's
        cost table, appends suffix chains inside the batch."""
        policy = next(iter(engine.policies.values()), None)
        costs = getattr(policy, "costs", None)
        drafts = (engine.draft is not None and engine.draft.config.algorithm == "eagle3"
                  and costs is not None and bool(costs.draft_ms))
        live = LiveCosts(costs) if costs is not None else None
        return cls(engine.target, engine.tokenizer, engine.eos_ids, max_batch, engine.max_model_len,
                   prefill_chunk, solo=engine if engine.speculative else None,
                   prefix_cache_tokens=prefix_cache_tokens,
                   chain_costs=live.target if live is not None else None,
                   draft=engine.draft if drafts else None, draft_costs=costs.draft if drafts else None,
                   chain_rows=max(costs.rows) if costs is not None else 1 << 30, monitor=engine.monitor,
                   live=live)

    def chain_mode(self) -> str:
        """What speculation inside the batch runs here, and why not where it does not."""
        if self.chains is None:
            return ("off: it needs a row-stable layout (this one is not)" if not self.row_stable else
                    "off: it needs the adaptive step's cost table (a speculative engine)")
        return ("each request appends a chain its suffix index" + (" or the EAGLE-3 draft" if self.draft else "")
                + " guesses where the machine's cost of the rows pays (greedy and sampled)")

    # ------------------------------------------------------------------ requests
    def _request(self, rid: int, prompt_ids: list[int], params: SamplingParams,
                 output: Output) -> BatchRequest:
        return BatchRequest(rid, prompt_ids, params, output, params.generator(self.target.device))

    def _drop(self, req: BatchRequest) -> None:
        """Cancelled: its slot is free for the next step."""
        self._end_solo(req)
        self._retire(req)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[Emitted]:
        """One forward over every running request's rows (or one speculative step of the request
        that runs alone); the chunks it produced."""
        self._admit()
        if not self.running:
            return []
        solo = [r for r in self.running if r.solo is not None]
        if solo and (len(self.running) > 1 or self.waiting):
            self._end_solo(solo[0])               # company: it joins the batch from its last token
        elif solo or self._may_go_solo():
            return self._solo_step(self.running[0])
        t_step = time.perf_counter()
        speculating = self.gate is None or self.gate.on
        if speculating and not self.spec_was_on:
            self._restart_drafts()
        self.spec_was_on = speculating
        self.checking = speculating and self.gate is not None and self.gate.check_due
        self.draft_quiet += 1
        blocks, guesses = self._blocks(speculating and not self.checking)
        trees = {i: guesses[req.id].ancestors() for i, (req, _, _) in enumerate(blocks)
                 if req.id in guesses and guesses[req.id].alternate}
        rows = self.cache.plan([(req.slot, len(ids)) for req, ids, _ in blocks], trees)
        picks, first = [], []             # the rows whose logits are wanted; each block's first pick
        for blk, (_, _, decodes) in zip(rows.blocks, blocks):
            first.append(len(picks))      # a decoding block: every row (its chain's); else the last
            picks.extend(range(blk.first_row if decodes else blk.first_row + blk.rows - 1,
                               blk.first_row + blk.rows))
        context = sum(req.fed for req, _, _ in blocks) / len(blocks)
        t0 = time.perf_counter()
        capture = {"capture_ids": self.capture_ids} if self.capture_ids and speculating else {}
        out = self.target.forward_rows(torch.tensor([t for _, ids, _ in blocks for t in ids]),
                                       rows, self.cache, torch.tensor(picks), **capture)
        logits, aux = out if capture else (out, None)
        step_s = time.perf_counter() - t0
        ready, emitted = [], []           # ready: the one-row blocks whose logits give a next token
        for i, (req, ids, decodes) in enumerate(blocks):
            blk = rows.blocks[i]
            if decodes and len(ids) > 1:  # its last token and a guess: checked row by row
                g = guesses[req.id]
                tokens, path = check_tree(logits[first[i]:first[i] + len(ids)], ids, g.parents(),
                                          req.params, req.gen)
                kept = len(tokens) - 1
                self.cache.keep(req.slot, blk.start, path)      # the path taken, in order
                req.fed += 1 + kept
                self._features(req, aux, path_rows(blk.first_row, path))
                g.observe(req.chain if g.source == "suffix" else req.chain.draft, path)
                if g.source == "draft":
                    self.draft_quiet = 0
                    self.draft_checked += 1
                done = Step(tokens, kept, verify_s=step_s, proposed=len(ids) - 1,
                            accepted_suffix=kept if g.source == "suffix" else 0, arm=g.source)
                if g.source == "draft" and self.monitor is not None:
                    self.monitor.observe(done)    # the draft's acceptance, as the solo engine's
                emitted.append(self._emit(req, done))
                continue
            req.fed += len(ids)
            self._features(req, aux, slice(blk.first_row, blk.first_row + len(ids)))
            if not decodes and self.prefixes is not None and not req.out_ids and not req.prefilling:
                self.prefixes.store(self.cache, req.slot, req.prompt_ids)   # its prompt, for later
            if decodes or (not req.prefilling and not req.out_ids):
                ready.append((first[i], req))
        tokens = sample_each(logits[[i for i, _ in ready]], [r.params for _, r in ready],
                             [r.gen for _, r in ready]) if ready else []
        emitted += [self._emit(req, Step([token], 0, verify_s=step_s)) for (_, req), token in zip(ready, tokens)]
        for req in [r for r in self.running if r.done]:
            self._retire(req)
        self._judge(blocks, emitted, context, 1e3 * step_s, 1e3 * (time.perf_counter() - t_step))
        return emitted

    def _judge(self, blocks, emitted: list[Emitted], context: float, forward_ms: float,
               wall_ms: float) -> None:
        """The step's forward to the live cost fit, and the step to the gate: a speculative one by
        the tokens its decoding requests got against plain decoding's predicted time."""
        if self.gate is None:
            return
        if not all(decodes for _, _, decodes in blocks):
            # a step with prompt rows says nothing here: the cost table's rows are decode steps'
            # (1-16 rows and their guesses), and a 512-row prompt piece, which costs a fraction of
            # that slope a row, read as ~6x dearer than it was; one such step in the gate's
            # average held speculation on where it ran at 0.91x plain (16 clients)
            return
        rows = sum(len(ids) for _, ids, _ in blocks)
        self.live.observe(rows, forward_ms, context)
        decoding = {req.id for req, _, decodes in blocks if decodes}
        base = len(decoding)
        model_ms = self.live.target(base, context)
        if not self.spec_was_on or self.checking:
            self.gate.observe_plain(wall_ms, model_ms)
            return
        got = sum(len(e.chunk.token_ids) for e in emitted if e.request.id in decoding)
        self.gate.observe(got, len(decoding), wall_ms, self.gate.plain_ms(model_ms))

    def _draft_probe(self, decoders: list[BatchRequest], plan: dict) -> None:
        """A draft chain of one token where none was checked in DRAFT_PROBE_EVERY batch steps
        (policy.draft_interval: every DRAFT_PROBE_FIRST until `draft_measure` chains were checked;
        counted over every step, taken at the first one speculating):
        the draft's own acceptance stays measured (the monitor, /health) when its chains never
        pay, so a broken draft is seen. The request whose draft has rows to draft from."""
        if (self.draft is None
                or self.draft_quiet < draft_interval(self.draft_checked, DRAFT_PROBE_EVERY, self.draft_measure)
                or any(o.source == "draft" for o, _ in plan.values())):
            return
        for r in decoders:
            d = r.chain.draft if r.chain is not None else None
            room = r.params.max_new_tokens - len(r.out_ids) - 1
            if r.params.speculative and d is not None and (d.waiting or d.head is not None) and room > 0:
                plan[r.id] = (Option(r.id, "draft", 1, d.rate, NO_EXTRA), 1)
                return

    def _restart_drafts(self) -> None:
        """Speculation back on after plain steps that captured no features: each request's draft
        chain starts over from its next token (its acceptance kept)."""
        for r in self.running:
            if r.chain is not None and r.chain.draft is not None:
                r.chain.draft.restart(r.fed)

    def _emit(self, req: BatchRequest, step: Step) -> Emitted:
        """The step's tokens through the request's Output; its suffix index takes what was emitted."""
        chunk = req.output.push(step)
        if req.chain is not None:
            req.chain.index.extend(chunk.token_ids)
        return Emitted(req, chunk)

    def _draft_ms(self, d: DraftChain, room: int, spend: DraftSpend) -> Callable[[int], float]:
        """A draft chain's ms outside the forward for k tokens: what its catch-up over the waiting
        rows and a row per token past the first add to the step's draft forwards (`spend`: one
        forward a level over every chain's rows). A step's worth of waiting rows is charged in
        full; past that (a prompt, a stretch of suffix chains) the catch-up is paid once for the
        rest of the request, so it is spread over the tokens it has left (each chain charged its
        share)."""
        step = d.catch_up_now
        later = self.draft_costs(d.waiting_rows) - self.draft_costs(step) if d.waiting_rows > step else 0.0
        return lambda k: (spend.added_ms(step, k)
                          + later * min(1.0, (1 + expected_tokens(d.rate, k)) / max(room, 1)))

    def _features(self, req: BatchRequest, aux: Optional[torch.Tensor], rows: slice | list[int]) -> None:
        """The target's features at the forward's `rows` (the request's tokens fed this step, in
        order), for its draft chain."""
        if aux is not None and req.chain is not None and req.chain.draft is not None:
            req.chain.draft.wait(aux[rows])

    def _chains(self, decoders: list[BatchRequest], rows: int) -> dict[int, Guess]:
        """{request id: its guess} for the decoding requests whose guesses pay this step
        (chains.py: a chain, or a chain and an alternate branch), given the step's other rows."""
        if self.chains is None or not decoders:
            return {}
        options, guesses = [], {}
        spend = DraftSpend(self.draft_costs) if self.draft is not None else None
        floor = self.chains.floor_rate(rows, len(decoders))
        for r in decoders:
            if not r.params.speculative:      # the request asked for plain decoding
                continue
            room = r.params.max_new_tokens - len(r.out_ids) - 1
            guess = r.chain.guess(room) if worth_asking(r.chain, floor) else []
            if guess:
                alt = r.chain.alternate(room)
                guesses[r.id] = (guess, alt)
                nodes = ranked_nodes(r.chain.rate, len(guess), r.chain.alt.rate, len(alt))
                options.append(Option(r.id, "suffix", len(nodes), r.chain.rate, NO_EXTRA, nodes=nodes,
                                      first=r.chain.chains == 0))
            d = r.chain.draft
            if d is not None and worth_asking(d, floor) and (d.waiting or d.head is not None):
                most = d.cap(room, DRAFT_MAX_TOKENS)
                nodes = ranked_nodes(d.rate, most, d.alt.rate, 1 if room > 0 else 0)
                opt = Option(r.id, "draft", len(nodes), d.rate, None, nodes=nodes, first=d.chains == 0)
                draft_ms = self._draft_ms(d, room, spend)     # only the chain's tokens are drafted
                options.append(opt._replace(
                    extra_ms=lambda k, o=opt, ms=draft_ms: ms(o.branches(k)[0]),
                    take=lambda k, o=opt, step=d.catch_up_now: spend.take(step, o.branches(k)[0])))
        plan = self.chains.plan(options, rows, len(decoders)) if options else {}
        self._draft_probe(decoders, plan)
        by_id = {r.id: r for r in decoders}
        drafts = [(rid, opt.branches(k)) for rid, (opt, k) in plan.items() if opt.source == "draft"]
        asks = [(by_id[rid].chain.draft, chain, by_id[rid].prompt_ids + by_id[rid].out_ids)
                for rid, (chain, _) in drafts]
        drafted = dict(zip([rid for rid, _ in drafts], self.drafts.guess_trees(asks) if asks else []))
        out = {}
        for rid, (opt, k) in plan.items():
            n_chain, n_alt = opt.branches(k)
            if opt.source == "suffix":
                chain, alt = guesses[rid][0][:n_chain], guesses[rid][1][:n_alt]
            else:               # every draft chain drafted at once; its runner-up first token
                chain, runner_up = drafted[rid]
                alt = [runner_up] if n_alt and runner_up is not None and chain else []
            if chain:           # siblings guess distinct tokens (a tie may rank one token twice)
                out[rid] = Guess(opt.source, chain, alt if alt and alt[0] != chain[0] else [])
        return out

    # ------------------------------------------------------------------ alone: speculative
    def _may_go_solo(self) -> bool:
        """A fresh greedy request alone in the batch with nobody waiting, and a solo engine."""
        if self.solo is None or len(self.running) != 1 or self.waiting:
            return False
        req = self.running[0]
        return req.params.greedy and req.params.speculative and req.fed == 0 and not req.out_ids

    def _solo_step(self, req: BatchRequest) -> list[Emitted]:
        """The prefill (first call) or one speculative step on the solo engine's caches."""
        if req.solo is None:
            req.solo = self.solo.start(req.prompt_ids, req.params, output=req.output)
        else:
            req.solo_steps += 1
        chunk = req.solo.step()
        if req.done:
            self._end_solo(req)
            self._retire(req)
        return [Emitted(req, chunk)]

    def _end_solo(self, req: BatchRequest) -> None:
        """Leave the solo engine. Its slot takes the solo cache's k/v of the prompt and output so
        far (what a prefill of them would write, bit for bit on a row-stable layout: the verify
        forwards computed each kept row as one-token decoding does); where that cache does not
        hold exactly those tokens, they are prefilled into the slot (chunked, not emitted)."""
        if req.solo is None:
            return
        if self._can_copy(req):
            decoder = req.solo.decoder
            self.cache.load(req.slot, decoder.cache, req.context_len)
            req.fed = req.context_len
            if self.draft is not None and decoder.draft is self.draft and req.chain is None:
                req.chain = ChainState()          # its draft keeps the context it had alone
                req.chain.index.extend(req.prompt_ids + req.out_ids)
                req.chain.draft = self.drafts.resume(decoder.draft_cache, decoder.pending, decoder.head,
                                                     decoder.draft_offset)
        req.solo.close()
        req.solo = None

    def _can_copy(self, req: BatchRequest) -> bool:
        """The solo cache holds exactly the tokens the slot needs, computed as the batch would."""
        cache = getattr(req.solo.decoder, "cache", None)
        return (self.row_stable and not req.done and req.slot is not None and req.fed == 0
                and cache is not None and cache.length == req.context_len)

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            req.slot = self.cache.allocate()
            self.running.append(req)

    def _blocks(self, speculating: bool = True) -> tuple[list[tuple[BatchRequest, list[int], bool]],
                                                          dict[int, Guess]]:
        """Each running request's tokens this step, and whether the block decodes (its logits give
        the next token), and each guess by request id: decoders first (their last token, then a
        guess where one pays: a chain, or a tree of a chain and an alternate branch, root first),
        then prompt chunks in order (a request back from solo prefills its prompt and output so far
        the same way)."""
        decoders = [r for r in self.running if not r.prefilling]
        for r in self.running:          # a fresh prompt starts from the longest cached prefix
            if self.prefixes is not None and r.fed == 0 and not r.out_ids and not r.prefix_seen:
                r.prefix_seen = True
                r.fed = r.output.cached_tokens = self.prefixes.load(
                    self.cache, r.slot, r.prompt_ids, len(r.prompt_ids) - 1, PREFIX_MIN)
        for r in self.running:          # after the prefix cache: a draft's features start at `fed`
            if self.chains is not None and r.chain is None:
                r.chain = ChainState()    # its index starts over the prompt and output so far
                r.chain.index.extend(r.prompt_ids + r.out_ids)
                if self.draft is not None:
                    r.chain.draft = self.drafts.open(r.fed)
        prefill, budget = [], self.prefill_chunk
        for r in self.running:
            if r.prefilling and budget:
                ids = r.context(r.fed, budget)
                prefill.append((r, ids, False))
                budget -= len(ids)
        guesses = (self._chains(decoders, len(decoders) + sum(len(ids) for _, ids, _ in prefill))
                   if speculating else {})
        blocks = [(r, [r.out_ids[-1]] + (guesses[r.id].tokens if r.id in guesses else []), True)
                  for r in decoders] + prefill
        return blocks, guesses

    def _retire(self, req: BatchRequest) -> None:
        if req.chain is not None and req.chain.draft is not None:
            req.chain.draft.close()
        if req.slot is not None:
            self.cache.release(req.slot)
            req.slot = None
        if req in self.running:
            self.running.remove(req)


def path_rows(first: int, path: list[int]) -> slice | list[int]:
    """The forward's rows of a block's path taken (block rows, from 0, increasing): a slice where
    they run in order (a chain's, read without a copy), else the rows themselves."""
    return slice(first, first + len(path)) if path[-1] == len(path) - 1 else [first + r for r in path]
