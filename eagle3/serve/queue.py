"""An asyncio queue in front of the engine, which serves one sequence at a time in its own thread.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from ..errors import InputError
from ..generate import Chunk, SamplingParams, Step

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
