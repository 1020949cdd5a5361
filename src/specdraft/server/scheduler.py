"""Continuous batching: one thread owns the engine and serves every request through it.

Requests wait in a bounded FIFO queue. Between two decoding steps the scheduler thread
cancels the rows whose clients left or whose time ran out, admits waiting requests into
the running batch (``engine.admit``) up to ``max_batch_size`` rows, runs one
``engine.step`` for all rows, and hands each ``StepEvent`` to its request.

Invariants:

* only the scheduler thread touches the engine and the batch, so no engine call ever
  runs concurrently with another;
* a job is in exactly one of: ``waiting`` (queued), ``active`` (admitted: prefilling or
  in the batch), or gone (finished, failed or cancelled). It moves from waiting to active
  under the lock *before* its prefill, so ``idle`` is never true while work is pending;
* a job's deliveries are, in order, zero or more ``StepEvent``s and then either one event
  carrying a ``result`` or one ``JobError``; nothing is delivered after that. A job
  cancelled by its client gets no further delivery at all.

Deliveries cross threads through ``deliver`` (for the HTTP side, a
``loop.call_soon_threadsafe`` into the request's asyncio queue), which must not block.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..engine import SpeculativeEngine, StepEvent
from ..sampling import SamplingParams

log = logging.getLogger("specdraft.server")


class QueueFull(Exception):
    """The waiting queue holds ``max_queue`` requests already."""


class NotAccepting(Exception):
    """The scheduler is draining or stopped."""


class JobError(Exception):
    """A job ended without a result; ``kind`` says why."""

    TIMEOUT, SHUTDOWN, ENGINE = "timeout", "shutdown", "engine"

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class Job:
    """One request as the scheduler sees it."""

    id: int
    prompt: list[int]
    params: SamplingParams
    deliver: Callable[[StepEvent | JobError], None]
    deadline: float | None  # time.monotonic() after which the job times out
    submitted: float = field(default_factory=time.monotonic)


class SchedulerMetrics:
    """Hooks the scheduler calls (no-ops here; the server passes a Prometheus-backed one)."""

    def queue(self, waiting: int, running: int) -> None: ...

    def step(self, rows: int, seconds: float) -> None: ...

    def tokens(self, n: int) -> None: ...

    def finished(self, tokens_per_step: float) -> None: ...

    def drafting(self, drafted_hist: dict[int, int], off_steps: int) -> None:
        """A finished request's decode steps by drafted depth, and how many ran with drafting off."""

    def ended(self, reason: str) -> None: ...


class Scheduler:
    """The continuous-batching loop around one ``SpeculativeEngine``."""

    def __init__(self, engine: SpeculativeEngine, max_batch_size: int = 8, max_queue: int = 64,
                 metrics: SchedulerMetrics | None = None):
        if max_batch_size < 1 or max_queue < 0:
            raise ValueError("max_batch_size must be >= 1 and max_queue >= 0")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.metrics = metrics or SchedulerMetrics()
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._active: dict[int, Job] = {}
        self._to_cancel: dict[int, JobError | None] = {}  # id -> error to deliver (None: silent)
        self._accepting = True
        self._stopping = False
        self._ids = itertools.count()
        self._batch = None
        self._thread = threading.Thread(target=self._run, name="specdraft-scheduler", daemon=True)

    # ---- called from any thread ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, prompt: list[int], params: SamplingParams, deliver: Callable,
               timeout: float | None = None) -> Job:
        """Queue a request; raises QueueFull or NotAccepting instead of blocking."""
        with self._cond:
            if not self._accepting:
                raise NotAccepting("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            deadline = None if timeout is None else time.monotonic() + timeout
            job = Job(next(self._ids), list(prompt), params, deliver, deadline)
            self._waiting.append(job)
            self._publish_depth()
            self._cond.notify()
        return job

    def cancel(self, job_id: int, error: JobError | None = None) -> None:
        """End a job early: at once if it is still waiting, else before the next step.
        ``error`` is delivered to it (None: nothing more is delivered)."""
        with self._cond:
            for job in self._waiting:
                if job.id == job_id:
                    self._waiting.remove(job)
                    self._publish_depth()
                    self._end(job, error, "cancelled" if error is None else error.kind)
                    return
            if job_id in self._active:
                self._to_cancel[job_id] = error
                self._cond.notify()

    def drain(self) -> None:
        """Stop accepting new jobs; those already submitted go on."""
        with self._cond:
            self._accepting = False

    def abort_all(self, error: JobError) -> None:
        """End every job, waiting or running, with ``error``."""
        with self._cond:
            while self._waiting:
                self._end(self._waiting.popleft(), error, error.kind)
            for job_id in self._active:
                self._to_cancel[job_id] = error
            self._publish_depth()
            self._cond.notify()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the thread; jobs still pending end with a shutdown error."""
        with self._cond:
            self._accepting = False
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def accepting(self) -> bool:
        return self._accepting

    def idle(self) -> bool:
        with self._cond:
            return not self._waiting and not self._active

    # ---- the scheduler thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._next_round():
                pass
        except Exception:  # a bug here must not leave requests waiting forever
            log.exception("the scheduler stopped")
        finally:
            self._fail_everything(JobError(JobError.SHUTDOWN, "the server shut down before the request finished"))

    def _next_round(self) -> bool:
        """One iteration: cancellations, admissions, a step. False when stopping."""
        with self._cond:
            while not (self._stopping or self._waiting or self._active):
                self._cond.wait()
            if self._stopping:
                return False
            cancels, self._to_cancel = self._to_cancel, {}
            cancels.update(self._expired())
            admitted = self._take_admissible(exclude=cancels)
        self._cancel_rows(cancels)
        if admitted:
            self._admit(admitted)
        if self._batch is not None and self._batch.rows:
            self._step()
        return True

    def _expired(self) -> dict[int, JobError]:
        """Jobs past their deadline (under the lock): waiting ones end here, active ones
        are returned for cancellation."""
        now = time.monotonic()
        late = lambda job: job.deadline is not None and now > job.deadline  # noqa: E731
        for job in [j for j in self._waiting if late(j)]:
            self._waiting.remove(job)
            self._end(job, self._timeout_error(job), JobError.TIMEOUT)
        return {j.id: self._timeout_error(j) for j in self._active.values() if late(j)}

    @staticmethod
    def _timeout_error(job: Job) -> JobError:
        waited = time.monotonic() - job.submitted
        return JobError(JobError.TIMEOUT, f"the request timed out after {waited:.1f} s")

    def _take_admissible(self, exclude: dict) -> list[Job]:
        """Move waiting jobs into ``active`` while the batch has room (under the lock)."""
        free = self.max_batch_size - (len(self._active) - len(exclude.keys() & self._active.keys()))
        taken = []
        while self._waiting and len(taken) < free:
            job = self._waiting.popleft()
            self._active[job.id] = job
            taken.append(job)
        self._publish_depth()
        return taken

    def _cancel_rows(self, cancels: dict[int, JobError | None]) -> None:
        ids = {i for i in cancels if i in self._active}
        if not ids:
            return
        if self._batch is not None:
            try:
                self.engine.cancel(self._batch, ids)
            except Exception as e:
                self._engine_failed(e)  # ends these jobs too (with an engine error)
                return
        with self._cond:
            for i in ids:
                error = cancels[i]
                self._end(self._active.pop(i), error, "cancelled" if error is None else error.kind)
            self._publish_depth()

    def _admit(self, jobs: list[Job]) -> None:
        prompts, params, ids = [j.prompt for j in jobs], [j.params for j in jobs], [j.id for j in jobs]
        try:
            if self._batch is None:
                self._batch, events = self.engine.start(prompts, params, ids)
            else:
                events = self.engine.admit(self._batch, prompts, params, ids)
        except Exception as e:
            if self._batch is not None and set(ids) & set(self._batch.request_ids):
                self._engine_failed(e)  # it failed while joining the batch: the batch is suspect
            else:  # it failed in the prefill, before touching the running batch
                log.exception("prefill failed")
                self._fail(jobs, JobError(JobError.ENGINE, f"the engine failed: {e}"))
            return
        self._dispatch(events)

    def _step(self) -> None:
        start = time.perf_counter()
        rows = len(self._batch.rows)
        try:
            events = self.engine.step(self._batch)
        except Exception as e:
            self._engine_failed(e)
            return
        self.metrics.step(rows, time.perf_counter() - start)
        self._dispatch(events)

    def _engine_failed(self, error: Exception) -> None:
        """The batch may be inconsistent now: end its jobs, drop it, keep serving (the next
        admission starts a new batch, which also resets the drafter)."""
        log.exception("the engine failed")
        self._batch = None
        self._fail(list(self._active.values()), JobError(JobError.ENGINE, f"the engine failed: {error}"))

    def _dispatch(self, events: list[StepEvent]) -> None:
        """Hand each event to its job. Counters and bookkeeping come first, so that a
        client holding its response always finds it counted and its row gone."""
        deliveries = []
        with self._cond:
            for event in events:
                job = self._active.get(event.request_id)
                if job is None:
                    continue
                self.metrics.tokens(len(event.new_ids))
                if event.result is not None:
                    del self._active[event.request_id]
                    self.metrics.finished(event.result.tokens_per_step)
                    self.metrics.drafting(event.result.drafted_hist, event.result.off_steps)
                    self.metrics.ended("finished")
                deliveries.append((job, event))
            self._publish_depth()
        for job, event in deliveries:
            _deliver_safely(job, event)

    def _fail(self, jobs: list[Job], error: JobError) -> None:
        with self._cond:
            for job in jobs:
                if self._active.pop(job.id, None) is not None:
                    self._end(job, error, error.kind)
            self._publish_depth()

    def _fail_everything(self, error: JobError) -> None:
        with self._cond:
            self._accepting = False
            jobs = list(self._waiting) + list(self._active.values())
            self._waiting.clear()
            self._active.clear()
            for job in jobs:
                self._end(job, error, error.kind)
            self._publish_depth()

    def _end(self, job: Job, error: JobError | None, reason: str) -> None:
        self.metrics.ended(reason)
        if error is not None:
            _deliver_safely(job, error)

    def _publish_depth(self) -> None:
        self.metrics.queue(len(self._waiting), len(self._active))


def _deliver_safely(job: Job, item) -> None:
    """A delivery that cannot take the scheduler down (e.g. the event loop is closed)."""
    try:
        job.deliver(item)
    except Exception:
        log.debug("could not deliver to job %d", job.id, exc_info=True)
