"""A bounded queue in front of the engine, in its own thread: EngineWorker serves one sequence at a
time (--max-batch 1, or a target without a batched forward); BatchWorker (at the end) decodes up
to max_batch sequences together (continuous batching; with a draft, speculative when one runs alone).

Request handlers put Jobs on a bounded asyncio.Queue (full -> QueueFull, answered 503). One consumer
task takes them in arrival order and runs each in a single worker thread, which iterates
`engine.stream(...)` and hands every Chunk back to the event loop through the job's own asyncio
queue, then END. A job's `cancelled` event (set when its client disconnects) is checked between
chunks: the generation stops within one engine step and the engine moves to the next job.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from ..errors import InputError
from ..generate import Chunk, SamplingParams, Step
from ..generate.batch import PREFIX_CACHE_TOKENS
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
    """Items for several jobs handed to their event loop in one wake-up: a batch step's chunks
    (16 streams at ~30 tokens/s each were ~500 cross-thread wake-ups a second, each a context
    switch on the cores the forward uses)."""

    def __init__(self):
        self.items: list[tuple[Job, object]] = []

    def add(self, job: Job, item: object) -> None:
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
    def __init__(self, engine, max_queue: int, after_job: Optional[Callable[[], None]] = None,
                 on_decode_step: Optional[Callable[[Step], None]] = None):
        if max_queue < 1:
            raise InputError(f"max_queue must be >= 1, got {max_queue}")
        self.engine, self.max_queue = engine, max_queue
        self.after_job = after_job     # called in the engine thread after each job, before END
        # called in the engine thread with every decode step the engine ran, those of cancelled
        # jobs included: the same steps the engine's acceptance monitor observes
        self.on_decode_step = on_decode_step
        self.queue: Optional[asyncio.Queue] = None
        self.running: Optional[Job] = None
        self.mean_job_s = 1.0          # moving average of job wall time (for Retry-After)
        self._executor: Optional[ThreadPoolExecutor] = None
        self._task: Optional[asyncio.Task] = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        hand_over_cores()          # the engine thread must be the one thread with an OpenMP team
        self.queue = asyncio.Queue(maxsize=self.max_queue)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="eagle3-engine")
        self._task = asyncio.create_task(self._consume(), name="eagle3-engine-queue")

    async def stop(self) -> None:
        """Cancel every job (the running one stops at its next chunk) and end the consumer."""
        if self._task is None:
            return
        if self.running is not None:
            self.running.cancel()
        while not self.queue.empty():
            self.queue.get_nowait().cancel()
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._task = None

    # ------------------------------------------------------------------ queue
    @property
    def waiting(self) -> int:
        return self.queue.qsize() if self.queue is not None else 0

    @property
    def busy(self) -> int:
        return int(self.running is not None)

    def submit(self, job: Job) -> None:
        if self.queue is None:
            raise RuntimeError("the engine worker is not started (run the app with its lifespan)")
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            raise QueueFull() from None

    def retry_after_s(self) -> int:
        return int(min(60, max(1, round(self.mean_job_s * (self.waiting + 1)))))

    async def _consume(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            job = await self.queue.get()
            if job.cancelled.is_set():
                job.push(END)
                continue
            self.running = job
            t0 = time.perf_counter()
            try:
                await loop.run_in_executor(self._executor, self._run, job)
            finally:
                self.running = None
                self.mean_job_s = 0.8 * self.mean_job_s + 0.2 * (time.perf_counter() - t0)

    # ------------------------------------------------------------------ worker thread
    def _run(self, job: Job) -> None:
        stream = self.engine.stream(prompt_ids=job.prompt_ids, params=job.params)
        try:
            for i, chunk in enumerate(stream):
                if i and self.on_decode_step is not None:
                    self.on_decode_step(chunk.step)
                job.push(chunk)
                if job.cancelled.is_set():
                    break
        except Exception as e:          # handed to the request, which answers with an error
            log.exception("generation failed")
            job.push(e)
        finally:
            stream.close()
            self._after_job()
            job.push(END)

    def _after_job(self) -> None:
        if self.after_job is not None:
            try:
                self.after_job()
            except Exception:
                log.exception("after-job hook failed")


class BatchWorker:
    """Continuous batching in front of an engine (generate.batch.BatchScheduler): plain rows for a
    batch; with a draft, a greedy request that runs alone decodes speculatively until another comes.

    Requests wait in a bounded queue (full -> QueueFull, answered 503) until a batch slot is free;
    one engine thread runs scheduler steps while any request is running, admitting waiting jobs
    between steps and handing each job its own Chunks (its stream), then END. A job's `cancelled`
    event is checked before every step: its slot is freed before the next forward.
    Same interface to the app as EngineWorker (start, stop, submit, waiting, busy, retry_after_s).
    """

    def __init__(self, engine, max_queue: int, max_batch: int,
                 after_job: Optional[Callable[[], None]] = None,
                 on_decode_step: Optional[Callable[[Step], None]] = None,
                 prefix_cache_tokens: int = PREFIX_CACHE_TOKENS):
        from ..generate.batch import BatchScheduler
        if max_queue < 1:
            raise InputError(f"max_queue must be >= 1, got {max_queue}")
        self.engine, self.max_queue, self.max_batch = engine, max_queue, max_batch
        self.scheduler = BatchScheduler.from_engine(engine, max_batch,
                                                    prefix_cache_tokens=prefix_cache_tokens)
        self.after_job, self.on_decode_step = after_job, on_decode_step
        self.pending: deque[Job] = deque()          # guarded by _wake
        self.jobs: dict[int, Job] = {}              # request id -> job (engine thread only)
        self.mean_job_s = 1.0
        self._wake = threading.Condition()
        self._stopping = False
        self._reset_prefixes = False                # guarded by _wake: empty them before a step
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

    def retry_after_s(self) -> int:
        # max_batch jobs run at once: the queue drains max_batch times faster than one at a time
        return int(min(60, max(1, round(self.mean_job_s * (self.waiting / self.max_batch + 1)))))

    # ------------------------------------------------------------------ engine thread
    def _serve(self) -> None:
        while self._next_jobs():
            self._drop_cancelled()
            try:
                emitted = self.scheduler.step()
            except Exception as e:     # handed to every running request, which answers with an error
                log.exception("batched generation failed")
                self._fail_running(e)
                continue
            for request, chunk in emitted:
                self._deliver(request, chunk)
            self.outbox.flush()                     # the step's chunks: one wake-up of the loop

    def _next_jobs(self) -> bool:
        """Wait for work; admit pending jobs into free slots. False once stopping."""
        with self._wake:
            while (not self._stopping and not self.pending and not self.scheduler.has_work
                   and not self._reset_prefixes):
                self._wake.wait()
            if self._stopping:
                return False
            if self._reset_prefixes:
                self.scheduler.prefixes.clear()
                self._reset_prefixes = False
            admitted = [self.pending.popleft()
                        for _ in range(min(len(self.pending), self.scheduler.free_slots))]
        for job in admitted:
            if job.cancelled.is_set():
                job.push(END)
                continue
            try:
                request = self.scheduler.add(job.prompt_ids, job.params)
            except Exception as e:     # checked by the app already: a request the engine refuses
                job.push(e)
                job.push(END)
                continue
            self.jobs[request.id] = job
        return True

    def _drop_cancelled(self) -> None:
        for request in list(self.scheduler.running):
            if self.jobs[request.id].cancelled.is_set():
                self.scheduler.cancel(request)
                self._finish(request)
        self.outbox.flush()

    def _deliver(self, request, chunk: Chunk) -> None:
        if len(request.steps) > 1 and self.on_decode_step is not None:   # steps[0]: the prefill
            self.on_decode_step(chunk.step)
        self.outbox.add(self.jobs[request.id], chunk)
        if request.done:
            self._finish(request)

    def _fail_running(self, e: Exception) -> None:
        for request in list(self.scheduler.running):
            self.outbox.add(self.jobs[request.id], e)
            self.scheduler.cancel(request)
            self._finish(request)
        self.outbox.flush()

    def _finish(self, request) -> None:
        job = self.jobs.pop(request.id)
        self.mean_job_s = 0.8 * self.mean_job_s + 0.2 * (time.perf_counter() - job.arrived)
        if self.after_job is not None:
            try:
                self.after_job()
            except Exception:
                log.exception("after-job hook failed")
        self.outbox.add(job, END)
