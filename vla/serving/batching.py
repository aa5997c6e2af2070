"""``MicroBatcher``: requests from concurrent connections run together on a model thread, off the event loop.

The event loop only decodes, validates and ``await``s; the model runs on one worker thread. The worker takes the
first waiting request, then collects more for at most the batch window (or until ``max_batch``, or at once when
``expect_more()`` says no other client can send one now), and runs them as
one ``Policy.infer_batch`` call — mixed embodiments and prompts in one forward pass. Each sample's noise comes from
its own seed, so its chunk is the same whatever batch it lands in. A sample whose chunk is non-finite gets its
error and the others their chunks from the same pass; when the batch fails as a whole, its samples are re-run one by
one so only the offending request gets the error. Results go back to the loop with
``call_soon_threadsafe``; a request whose client went away meanwhile is dropped, never blocking the others.

The window is fixed (``window_s``) or, with ``window_s=None`` (``vla serve``'s default, ``--batch-window-ms auto``),
``AUTO_WINDOW_FRACTION`` of the measured forward time (a moving average over recent batches), at most
``AUTO_WINDOW_MAX_S``. Waiting is worth it in proportion to that time: a request that misses a batch waits for the
whole pass before its own starts, so waiting a tenth of a pass to take it along costs the first request at most 10 %
more latency. A fixed 2 ms window closes on a CPU before the clients just answered (all at once, by the same batch)
have sent again, and 20 ms would quadruple a 5 ms GPU pass; the fraction fits both. A lone client never waits
(``expect_more``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from vla.policy import ActionChunk
from vla.serving.metrics import ServerMetrics
from vla.types import Observation

log = logging.getLogger(__name__)

# One chunk per observation; a sample's own failure (a non-finite chunk) may take its place as an exception.
InferBatch = Callable[[Sequence[Observation], Sequence[int | None]], Sequence[ActionChunk | BaseException]]


T = TypeVar("T")

AUTO_WINDOW_FRACTION = 0.1  # of the forward time: the most extra latency batching may cost the first request
AUTO_WINDOW_MAX_S = 0.05  # a slow model's window stays short of what a control loop notices
_FORWARD_EMA = 0.2  # weight of the newest batch in the forward-time average


class ModelThread:
    """One long-lived daemon thread for all model work: ``call(fn, ...)`` runs ``fn`` there and returns its result
    (or raises its exception); ``MicroBatcher`` runs its loop there too, which occupies the thread until the
    batcher is closed (a ``call`` meanwhile is refused: it would wait forever). ``close()`` ends the thread after
    what is queued. Why one thread: see the module docstring."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], object], concurrent.futures.Future] | None] = (
            queue.SimpleQueue()
        )
        self.occupied_by: str | None = None  # a loop that holds the thread until it returns
        self._thread = threading.Thread(target=self._work, name="vla-serve-model", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            fn, future = task
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # handed to the caller, who raises it
                    future.set_exception(e)
            del task, fn, future  # hold nothing (a closed batcher's policy) while waiting for the next task

    def submit(self, fn: Callable[..., T], *args, **kwargs) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args, **kwargs)`` on the thread (after what is queued or running there) and return its
        future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._tasks.put((functools.partial(fn, *args, **kwargs), future))
        return future

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("ModelThread.call from the model thread itself would wait for itself forever")
        if self.occupied_by is not None:
            raise RuntimeError(
                f"the model thread runs {self.occupied_by} until it is closed; a call now would wait forever"
            )
        return self.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """End the thread once what is queued has run (idempotent)."""
        self._tasks.put(None)


class OverloadedError(RuntimeError):
    """More requests are waiting than the server accepts; retry later or add servers."""


@dataclass
class Result:
    """One request's chunk and the time of the forward pass it ran in (``infer_ms``) with its batch size."""

    chunk: ActionChunk
    infer_ms: float
    batch_size: int


@dataclass
class _Job:
    obs: Observation
    seed: int | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Result] = field(repr=False)


class MicroBatcher:
    """Queue + one model thread. ``await submit(obs, seed)`` -> ``Result`` (or the request's own exception).

    ``window_s``: the longest wait for more requests after the first, in seconds; ``None``: adaptive (see the module
    docstring; ``window_s`` then reads the current one). ``forward_s``: the expected seconds of one forward pass
    (``vla serve`` passes its warm-up measurement) to size the adaptive window before the first batch has run.
    ``model_thread``: the thread the model was loaded on (``vla serve`` passes the one it loaded and warmed the
    policy on); by default a new one."""

    def __init__(
        self,
        infer_batch: InferBatch,
        *,
        max_batch: int,
        window_s: float | None,
        metrics: ServerMetrics | None = None,
        max_queue: int = 1024,
        expect_more: Callable[[], bool] | None = None,
        model_thread: ModelThread | None = None,
        forward_s: float | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
        if window_s is not None and window_s < 0:
            raise ValueError(f"--batch-window-ms must be >= 0 or 'auto', got {window_s * 1000:g}")
        self.infer_batch, self.max_batch, self.fixed_window_s = infer_batch, max_batch, window_s
        self.forward_s = forward_s  # moving average of a batch's forward seconds (None until known)
        self.metrics, self.max_queue = metrics, max_queue
        # Whether another request can still arrive (a client without one in flight): when none can, the window is
        # not waited for (a lone robot pays no batching latency).
        self.expect_more = expect_more or (lambda: True)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._busy = 0  # requests taken off the queue and not yet answered (read by the drain on shutdown)
        self._owns_thread = model_thread is None
        self.model_thread = model_thread or ModelThread()
        self.model_thread.occupied_by = "the micro-batcher's loop"
        if self.metrics is not None:
            self.metrics.batch_window.set(self.window_s)
        self._loop_done = self.model_thread.submit(self._run)
        self._loop_done.add_done_callback(self._loop_ended)

    @property
    def adaptive(self) -> bool:
        """Whether the window follows the measured forward time (``window_s=None``)."""
        return self.fixed_window_s is None

    @property
    def window_s(self) -> float:
        """The wait for more requests the next batch gets (seconds)."""
        if self.fixed_window_s is not None:
            return self.fixed_window_s
        return min(AUTO_WINDOW_MAX_S, AUTO_WINDOW_FRACTION * (self.forward_s or 0.0))

    @property
    def pending(self) -> int:
        """Requests queued or running."""
        return self._queue.qsize() + self._busy

    async def submit(self, obs: Observation, seed: int | None) -> Result:
        if self._queue.qsize() >= self.max_queue:
            raise OverloadedError(
                f"server overloaded: {self.max_queue} requests already waiting; retry later"
            )
        loop = asyncio.get_running_loop()
        job = _Job(obs, seed, loop, loop.create_future())
        self._queue.put(job)
        self._gauge()
        return await job.future

    def close(self, timeout: float | None = None) -> None:
        """Finish what is queued, then stop the loop (and the model thread, when the batcher made it)."""
        self._queue.put(None)
        concurrent.futures.wait([self._loop_done], timeout)
        if self._owns_thread:
            self.model_thread.close()

    def _loop_ended(self, done: concurrent.futures.Future[None]) -> None:
        self.model_thread.occupied_by = None
        if (error := done.exception()) is not None:  # requests would wait forever: say so loudly
            log.error("the micro-batcher's loop died; no request will be answered", exc_info=error)

    # ---- model thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            jobs = self._collect(first)
            self._gauge()
            if jobs:
                self._busy = len(jobs)
                self._run_batch(jobs)
                self._busy = 0

    def _collect(self, first: _Job) -> list[_Job]:
        """``first`` plus what arrives within the window (and whatever is already waiting), up to ``max_batch``."""
        jobs = [first]
        deadline = time.perf_counter() + self.window_s
        while len(jobs) < self.max_batch:
            remaining = deadline - time.perf_counter()
            wait = remaining > 0 and self.expect_more()
            try:
                job = self._queue.get(timeout=remaining) if wait else self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:  # shutting down: run what we have, then stop
                self._queue.put(None)
                break
            jobs.append(job)
        return [j for j in jobs if not j.future.done()]  # clients that went away are skipped

    def _run_batch(self, jobs: list[_Job]) -> None:
        start = time.perf_counter()
        try:
            chunks: list[ActionChunk | BaseException] = list(
                self.infer_batch([j.obs for j in jobs], [j.seed for j in jobs])
            )
        except Exception as e:
            if len(jobs) == 1:
                chunks = [e]
            else:  # isolate the failing sample(s): same seeds, same chunks for the others
                chunks = []
                for j in jobs:
                    try:
                        chunks.append(self.infer_batch([j.obs], [j.seed])[0])
                    except Exception as e1:
                        chunks.append(e1)
        seconds = time.perf_counter() - start
        if not any(isinstance(c, BaseException) for c in chunks):  # a clean pass, not one-by-one re-runs
            self._observe_forward(seconds)
        if self.metrics is not None:
            self.metrics.inference.observe(seconds)
            self.metrics.batch_size.observe(len(jobs))
            self.metrics.batch_window.set(self.window_s)
        for job, chunk in zip(jobs, chunks):
            value = chunk if isinstance(chunk, BaseException) else Result(chunk, seconds * 1000, len(jobs))
            job.loop.call_soon_threadsafe(_resolve, job.future, value)

    def _observe_forward(self, seconds: float) -> None:
        """Fold one clean pass into the forward-time average; a one-off stall (GC, a recompile) counts as at most
        4x the average, so the window stays short."""
        if self.forward_s is None:
            self.forward_s = seconds
        else:
            sample = min(seconds, 4 * self.forward_s)
            self.forward_s = _FORWARD_EMA * sample + (1 - _FORWARD_EMA) * self.forward_s

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(self._queue.qsize())


def _resolve(future: asyncio.Future[Result], value: Result | BaseException) -> None:
    if future.done():  # cancelled: the client disconnected while its request ran
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)
