"""A bounded queue and one engine thread in front of a scheduler (generate.scheduler.Scheduler):
SerialScheduler serves one sequence at a time (--max-batch 1, or a target without a batched
forward); BatchScheduler decodes up to max_batch sequences together (continuous batching; with a
draft, speculative when one runs alone).

Request handlers submit Jobs; past max_queue waiting jobs, QueueFull (answered 503). The engine
thread admits waiting jobs into the scheduler's free slots between steps, runs scheduler steps
while any request is running, and hands each job its own Chunks (its stream), then END. A job's
`cancelled` event (set when its client disconnects) is checked before every step: its request
stops and frees its slot before the next forward.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from ..errors import InputError
from ..generate import Chunk, SamplingParams, Step
from ..generate.scheduler import Request, Scheduler
from ..threads import hand_over_cores

log = logging.getLogger("eagle3.serve")

END = object()   # sentinel: the job has finished (normally, by error or by cancellation)


class QueueFull(Exception):
    pass


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.perf_counter)
    out: asyncio.Queue = field(default_factory=asyncio.Queue)   # Chunk | Exception | END
    cancelled: threading.Event = field(default_factory=threading.Event)
    admitted: float = 0.0           # when the scheduler took it (engine thread)
    learn: bool = True              # may a learning server capture it (the request's "learn")

    def push(self, item: Union[Chunk, Exception, object]) -> None:
        """Thread-safe hand-over to the event loop (dropped if the loop has already closed)."""
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


def _put_all(items: list[tuple[Job, object]]) -> None:
    for job, item in items:
        job.out.put_nowait(item)


class Outbox:
    """Items for several jobs handed to their event loop in one wake-up: a step's chunks for every
    running request (a wake-up per chunk is a context switch on the cores the forward uses)."""

    def __init__(self):
        self.items: list[tuple[Job, object]] = []

    def add(self, job: Job, item: Union[Chunk, Exception, object]) -> None:
        self.items.append((job, item))

    def flush(self) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for job, item in self.items:
            by_loop.setdefault(job.loop, []).append((job, item))
        self.items = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:       # the loop has closed: nobody reads these jobs any more
                for job, _ in items:
                    job.cancelled.set()


class EngineWorker:
    """The one engine thread and its bounded queue (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, max_queue: int,
                 after_job: Optional[Callable[[], None]] = None,
                 on_decode_step: Optional[Callable[[Step], None]] = None):
        if max_queue < 1:
            raise InputError(f"max_queue must be >= 1, got {max_queue}")
        self.scheduler, self.max_queue = scheduler, max_queue
        self.after_job = after_job     # called in the engine thread after each job, before END
        # called in the engine thread with every decode step the engine ran, those of cancelled
        # jobs included: the same steps the engine's acceptance monitor observes
        self.on_decode_step = on_decode_step
        self.pending: deque[Job] = deque()          # guarded by _wake
        self.jobs: dict[Request, Job] = {}          # engine thread only
        self.mean_job_s = 1.0          # moving average of a job's time in the scheduler
        self._wake = threading.Condition()
        self._stopping = False
        self._reset_prefixes = False                # guarded by _wake: empty them before a step
        self._tasks: deque[Callable[[], None]] = deque()   # guarded by _wake: run between steps
        # learning (eagle3.learn): each job that ran to its end, with its request; and the engine
        # turning busy (True) or idle (False). Both called in the engine thread.
        self.on_finished: Optional[Callable[[Job, Request], None]] = None
        self.on_busy: Optional[Callable[[bool], None]] = None
        self._thread: Optional[threading.Thread] = None
        self.outbox = Outbox()                      # engine thread only: a step's deliveries

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        hand_over_cores()          # the engine thread must be the one thread with an OpenMP team
        self._thread = threading.Thread(target=self._serve, name="eagle3-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """End the engine thread after its current step; every job still open gets END."""
        if self._thread is None:
            return
        with self._wake:
            self._stopping = True
            self._wake.notify()
        await asyncio.to_thread(self._thread.join, 30)
        with self._wake:
            left, self.pending = list(self.pending), deque()
        for job in left + list(self.jobs.values()):
            job.cancel()
            job.push(END)
        self._thread = None

    # ------------------------------------------------------------------ queue
    @property
    def waiting(self) -> int:
        return len(self.pending)

    @property
    def busy(self) -> int:
        return len(self.scheduler.running)

    def submit(self, job: Job) -> None:
        if self._thread is None:
            raise RuntimeError("the engine worker is not started (run the app with its lifespan)")
        with self._wake:
            if len(self.pending) >= self.max_queue:
                raise QueueFull()
            self.pending.append(job)
            self._wake.notify()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache before the next step (on the engine thread, which owns it):
        requests submitted after this call never see a prefix stored before it. False: no cache."""
        if self.scheduler.prefixes is None:
            return False
        with self._wake:
            self._reset_prefixes = True
            self._wake.notify()
        return True

    def run_between_steps(self, task: Callable[[], None]) -> None:
        """Run `task` on the engine thread before its next step (or at once when idle): a draft
        swap happens there, never inside a step."""
        with self._wake:
            self._tasks.append(task)
            self._wake.notify()

    def retry_after_s(self) -> int:
        # max_batch jobs run at once: the queue drains max_batch times faster than one at a time
        batch = self.scheduler.max_batch
        return int(min(60, max(1, round(self.mean_job_s * (self.waiting / batch + 1)))))

    # ------------------------------------------------------------------ engine thread
    def _serve(self) -> None:
        while self._next_jobs():
            self._drop_cancelled()
            try:
                emitted = self.scheduler.step()
            except Exception as e:     # handed to every running request, which answers with an error
                log.exception("generation failed")
                self._end_running(e)
                continue
            for request, chunk in emitted:
                self._deliver(request, chunk)
            self.outbox.flush()                     # the step's chunks: one wake-up of the loop
        for request in list(self.jobs):             # stopping: the scheduler lets them go
            self.scheduler.cancel(request)

    def _next_jobs(self) -> bool:
        """Wait for work; admit pending jobs into free slots. False once stopping."""
        with self._wake:
            while (not self._stopping and not self.pending and not self.scheduler.has_work
                   and not self._reset_prefixes and not self._tasks):
                if self.on_busy is not None:
                    self.on_busy(False)
                self._wake.wait()
            if self._stopping:
                return False
            if self._reset_prefixes:
                self.scheduler.prefixes.clear()
                self._reset_prefixes = False
            admitted = [self.pending.popleft()
                        for _ in range(min(len(self.pending), self.scheduler.free_slots))]
            tasks, self._tasks = list(self._tasks), deque()
        for task in tasks:
            try:
                task()
            except Exception:
                log.exception("a between-steps task failed")
        if self.on_busy is not None and (admitted or self.scheduler.has_work):
            self.on_busy(True)
        for job in admitted:
            self._admit(job)
        return True

    def _admit(self, job: Job) -> None:
        if job.cancelled.is_set():
            self.outbox.add(job, END)
            return
        try:
            request = self.scheduler.add(job.prompt_ids, job.params)
        except Exception as e:         # checked by the app already: a request the engine refuses
            self.outbox.add(job, e)
            self.outbox.add(job, END)
            return
        job.admitted = time.perf_counter()
        self.jobs[request] = job

    def _drop_cancelled(self) -> None:
        for request, job in list(self.jobs.items()):
            if job.cancelled.is_set():
                self.scheduler.cancel(request)
                self._finish(request)
        self.outbox.flush()

    def _deliver(self, request: Request, chunk: Chunk) -> None:
        if len(request.output.steps) > 1 and self.on_decode_step is not None:  # [0]: the prefill
            self.on_decode_step(chunk.step)
        self.outbox.add(self.jobs[request], chunk)
        if request.done:
            self._finish(request)

    def _end_running(self, e: Exception) -> None:
        for request in list(self.jobs):
            self.outbox.add(self.jobs[request], e)
            self.scheduler.cancel(request)
            self._finish(request)
        self.outbox.flush()

    def _finish(self, request: Request) -> None:
        job = self.jobs.pop(request)
        self.mean_job_s = 0.8 * self.mean_job_s + 0.2 * (time.perf_counter() - job.admitted)
        if self.on_finished is not None and request.output.finish in ("stop", "length"):
            try:
                self.on_finished(job, request)
            except Exception:
                log.exception("finished-job hook failed")
        if self.after_job is not None:
            try:
                self.after_job()
            except Exception:
                log.exception("after-job hook failed")
        self.outbox.add(job, END)
