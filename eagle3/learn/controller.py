"""The server's side of learning: capture, the learner process, the swap and the rollback.

Threads: the engine thread calls `finished` (a record queued for the capture writer) and
`set_busy` (DIR/learner/pause written or removed when the engine turns busy or idle); a watcher
thread (`poll`, every `poll_s`) starts the learner when `min_tokens` new tokens are captured,
notices its exit, loads a new DIR/drafts/current as an inference layout (the server's `load_layout`)
and hands the swap to the engine thread (`run_in_engine`), which runs it between two steps.

A swap changes the draft new requests start with (`swap_draft`); a request already decoding keeps
the draft it started with, and every draft's tokens are verified by the target, so outputs are
the target's before, during and after. The rollback watch: the live acceptance monitor's tau over
the steps since the swap (at least `rollback_steps`) against the old version's over the steps
before it; worse by more than `rollback_tolerance` and the old version is served again, with a
log line saying why (its card records the rollback).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

from . import versions
from .capture import TrafficCapture, check_identity
from .learner import pause_path, pending_tokens

log = logging.getLogger("eagle3.learn")

LEARNER_STATES = ("idle", "running", "paused", "failed", "swapping")   # swapping: a version loads


class LearnOptions(NamedTuple):
    root: Path
    min_tokens: int = 20000
    max_bytes: int = 2 << 30
    learner_args: tuple[str, ...] = ()       # extra flags for python -m eagle3.learn
    rollback_steps: int = 256
    rollback_tolerance: float = 0.05
    poll_s: float = 2.0
    spawn: bool = True                       # False: never start a learner (tests)


class Watch(NamedTuple):
    old_version: int
    old_tau: float
    steps: int                              # monitor counters at the swap
    accepted: int


def swap_draft(engine, scheduler, layout) -> None:
    """Engine thread, between steps: the draft new requests start with (the engine's, the batch's
    draft chains'). Running requests keep theirs. A first draft on an engine without one needs
    `attach_first_draft` first."""
    engine.draft = layout
    if getattr(scheduler, "draft", None) is not None and layout is not None:
        scheduler.draft = layout
        scheduler.drafts.draft = layout


def attach_first_draft(engine, layout, policy_factory) -> Optional[str]:
    """Give a draftless engine its first draft: its caches and the policy over its costs. Returns
    why it cannot (None: done); the engine is left untouched then."""
    from ..speculative.decoder import cache_slack
    from ..speculative.tree import SpecParams
    policies = {greedy: policy_factory(greedy) for greedy in (True, False)}
    shapes = [s for p in policies.values() for s in p.shapes]
    slack = cache_slack(shapes, max(p.suffix_only_tokens for p in policies.values()))
    have = engine.cache.max_len if hasattr(engine.cache, "max_len") else None
    if have is not None and have < engine.max_model_len + slack:
        return (f"the target's cache holds {have} rows and the draft's trees need "
                f"{engine.max_model_len + slack}: restart the server to serve it")
    engine.draft_cache = layout.new_cache(engine.max_model_len + slack)
    engine.spec = engine.spec or SpecParams()
    engine.policy_factory, engine.policies = policy_factory, policies
    engine.draft = layout
    return None


class LearnController:
    def __init__(self, opts: LearnOptions, identity: dict, served: Optional[Path],
                 load_layout: Callable[[Optional[Path]], object],
                 run_in_engine: Optional[Callable[[Callable[[], None]], None]] = None):
        """Raises ContractError when the directory holds another target's traffic."""
        self.opts, self.root = opts, Path(opts.root)
        check_identity(self.root, identity)
        self.capture = TrafficCapture(self.root, opts.max_bytes)
        self.version = 0
        versions.ensure_v0(self.root, served)
        self.load_layout, self.run_in_engine = load_layout, run_in_engine
        self.engine = self.scheduler = None
        self.first_policy: Optional[Callable] = None     # policy factory for a first draft
        self.swaps = self.rollbacks = 0
        self.learner: Optional[subprocess.Popen] = None
        self.learner_state = "idle"
        self.busy = False
        self.watch: Optional[Watch] = None
        self.base = (0, 0)                               # monitor counters when this version began
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ wiring
    def attach(self, engine, scheduler, run_in_engine: Callable[[Callable[[], None]], None],
               first_policy: Optional[Callable] = None) -> None:
        self.engine, self.scheduler, self.run_in_engine = engine, scheduler, run_in_engine
        self.first_policy = first_policy

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="eagle3-learn", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.capture.close()
        pause_path(self.root).unlink(missing_ok=True)
        if self.learner is not None and self.learner.poll() is None:
            self._signal_learner(signal.SIGCONT)   # a stopped process takes SIGTERM only once continued
            self.learner.terminate()       # it resumes from its checkpoint at the next start

    # ------------------------------------------------------------------ engine thread
    def finished(self, prompt_ids: list[int], reply_ids: list[int], temperature: float, opt_in: bool) -> None:
        if opt_in:
            self.capture.record(prompt_ids, reply_ids, temperature)

    def set_busy(self, busy: bool) -> None:
        """Pause the learner while requests are queued or running: the process is stopped at once
        (SIGSTOP; SIGCONT when idle again), and a file it polls between steps says the same to a
        learner started meanwhile. Paused between steps only, a training step or a feature part
        already under way ran on beside the requests: 4 streaming clients got 0.74x the server's
        tokens/s without --learn."""
        if busy == self.busy:
            return
        self.busy = busy
        self._signal_learner(signal.SIGSTOP if busy else signal.SIGCONT)
        path = pause_path(self.root)
        try:
            if busy:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            else:
                path.unlink(missing_ok=True)
        except OSError as e:
            log.error("learn: cannot %s %s (%s); the learner runs on at nice 19",
                      "write" if busy else "remove", path, e)

    def _signal_learner(self, sig: int) -> None:
        proc = self.learner
        if proc is None:
            return
        try:
            os.kill(proc.pid, sig)
        except OSError:                      # it has just ended: the watcher sees it
            pass

    # ------------------------------------------------------------------ watcher thread
    def _loop(self) -> None:
        while not self._stop.wait(self.opts.poll_s):
            try:
                self.poll()
            except Exception:
                log.exception("learn: the watcher failed a round; the served draft keeps serving")

    def poll(self) -> None:
        self._check_learner()
        self._check_current()
        self._check_rollback()
        if (self.opts.spawn and self.learner is None and self.watch is None
                and pending_tokens(self.root) >= self.opts.min_tokens):
            self.start_learner()

    def start_learner(self) -> None:
        cmd = [sys.executable, "-m", "eagle3.learn", "--dir", str(self.root), *self.opts.learner_args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.learner = subprocess.Popen(cmd, env=env, preexec_fn=learner_preexec,
                                        stdout=open(self.root / "learner" / "learner.log", "ab"),
                                        stderr=subprocess.STDOUT)
        self.learner_state = "running"
        if self.busy:
            self._signal_learner(signal.SIGSTOP)
        log.info("learn: learner started (pid %d, %d new tokens); log %s", self.learner.pid,
                 pending_tokens(self.root), self.root / "learner" / "learner.log")

    def _check_learner(self) -> None:
        if self.learner is None:
            return
        rc = self.learner.poll()
        if rc is None:
            self.learner_state = "paused" if self.busy else "running"
            return
        self.learner = None
        self.learner_state = "idle" if rc == 0 else "failed"
        if rc != 0:
            log.error("learn: the learner exited with status %d (see %s); the served draft keeps "
                      "serving, and the round resumes from its checkpoint at the next start", rc,
                      self.root / "learner" / "learner.log")

    def _check_current(self) -> None:
        cur = versions.current(self.root)
        if cur is None or cur == self.version:
            return
        self.swap_to(cur, watch=True)

    def swap_to(self, version: int, watch: bool) -> None:
        """Load `version`'s draft here (this thread), swap it in on the engine thread. The learner
        state reads `swapping` until it serves: a finished learner read `idle` while a first draft's
        costs were still measured, and a client that took that for done stopped the server first."""
        before, self.learner_state = self.learner_state, "swapping"
        try:
            self._swap_to(version, watch)
        finally:
            if self.learner_state == "swapping":
                self.learner_state = before

    def _swap_to(self, version: int, watch: bool) -> None:
        path = versions.draft_path(self.root, version)
        try:
            layout = self.load_layout(path) if path is not None else None
        except Exception as e:
            log.error("learn: v%d cannot be served (%s); v%d keeps serving", version, e, self.version)
            versions.set_current(self.root, self.version)
            return
        old, done = self.version, threading.Event()
        old_tau = self.live_tau(self.base)
        first = None                 # a first draft's policy (its costs measured here, not in a step)
        if self.engine is not None and self.engine.draft is None and layout is not None and self.first_policy:
            first = self.first_policy(layout)

        def swap() -> None:
            try:
                self._swap(layout, version, first)
            finally:
                done.set()
        self.run_in_engine(swap)
        done.wait(60)
        self.version = version
        self.swaps += 1
        self.base = self.counters()
        self.watch = Watch(old, old_tau, *self.base) if watch and old_tau is not None else None
        log.info("learn: serving v%d (was v%d)%s", version, old,
                 f"; its live tau is compared with v{old}'s {old_tau:.3f}" if self.watch else "")

    def _swap(self, layout, version: int, first_policy=None) -> None:
        if self.engine is None:
            return
        if self.engine.draft is None and layout is not None:
            why = (attach_first_draft(self.engine, layout, first_policy) if first_policy
                   else "the server gave no policy for a first draft")
            if why:
                log.error("learn: v%d not served: %s", version, why)
                return
        swap_draft(self.engine, self.scheduler, layout)

    def counters(self) -> tuple[int, int]:
        mon = getattr(self.engine, "monitor", None)
        return (mon.steps, mon.accepted) if mon is not None else (0, 0)

    def live_tau(self, since: tuple[int, int]) -> Optional[float]:
        steps, accepted = self.counters()
        n = steps - since[0]
        return 1.0 + (accepted - since[1]) / n if n >= self.opts.rollback_steps else None

    def _check_rollback(self) -> None:
        if self.watch is None:
            return
        tau = self.live_tau((self.watch.steps, self.watch.accepted))
        if tau is None:
            return
        w, self.watch = self.watch, None
        if tau >= w.old_tau * (1 - self.opts.rollback_tolerance):
            log.info("learn: v%d kept: live tau %.3f vs v%d's %.3f", self.version, tau, w.old_version, w.old_tau)
            return
        bad = self.version
        log.warning("learn: rolled back v%d -> v%d: live tau %.3f over %d steps is below v%d's %.3f "
                    "(tolerance %.0f%%)", bad, w.old_version, tau, self.counters()[0] - w.steps,
                    w.old_version, w.old_tau, 100 * self.opts.rollback_tolerance)
        card = versions.card(self.root, bad)
        versions.write_card(self.root, bad, {**{k: v for k, v in card.items() if k != "version"},
                                             "status": "rolled back", "live_tau": round(tau, 4),
                                             "parent_live_tau": round(w.old_tau, 4)})
        versions.set_current(self.root, w.old_version)
        self.rollbacks += 1
        self.swap_to(w.old_version, watch=False)

    # ------------------------------------------------------------------ /metrics
    def snapshot(self) -> dict:
        return {"draft_version": self.version, "swaps": self.swaps, "rollbacks": self.rollbacks,
                "captured_tokens": self.capture.tokens_written,
                "learner_state": self.learner_state, "capture_write_errors": self.capture.write_errors}


def learner_preexec() -> None:
    """The learner process: nice 19, and killed with the server (Linux PR_SET_PDEATHSIG): a
    learner stopped while the server was busy cannot notice its parent is gone by itself."""
    os.nice(19)
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass
