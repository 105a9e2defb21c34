"""Dynamic batching: concurrent requests share one forward on the device.

The first request waiting opens a window of ``queue_delay_s``; requests that
arrive in it and can share one forward call (same dtype and routing mode, see
``ModelRequest.batch_key``) join until ``max_batch_tokens`` is reached. The rows
are stacked, run once, and split back in the same order, so each caller gets
exactly its own rows. Forward calls run one at a time on a single device
thread; while one runs, the next batch gathers.

With ``finish`` given, ``run_batch`` only launches a batch (stages its rows and enqueues the
device work, without waiting for the device) and ``finish`` waits for that batch and returns
``(outputs, stage_seconds)`` in a completion thread. Then up to ``max_in_flight`` batches are
under way at once: the next batch is gathered and staged on the host while the device runs
this one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from .model import ModelRequest

log = logging.getLogger("megamoe.service.batching")


class ShuttingDown(RuntimeError):
    """A request that arrived after shutdown began (not a device failure)."""


@dataclass
class BatchResult:
    output: torch.Tensor
    queue_s: float
    compute_s: float
    batch_requests: int
    batch_tokens: int


@dataclass
class _Waiting:
    request: ModelRequest
    future: asyncio.Future
    enqueued_s: float


class DynamicBatcher:
    def __init__(
        self,
        run_batch: Callable[[list[ModelRequest]], list[torch.Tensor]],
        executor: Executor,
        *,
        max_batch_tokens: int,
        queue_delay_s: float,
        on_batch: Callable[[int, int, float], None] | None = None,
        finish: Callable | None = None,
        on_stages: Callable[[dict], None] | None = None,
        max_in_flight: int = 2,
    ):
        self._run_batch = run_batch
        self._executor = executor
        self._finish = finish
        self._on_stages = on_stages
        self._max_in_flight = max_in_flight
        self._slots: asyncio.Semaphore | None = None
        self._in_flight: set[asyncio.Task] = set()
        self._completer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megamoe-complete") if finish else None
        self.max_batch_tokens = max_batch_tokens
        self.queue_delay_s = queue_delay_s
        self._on_batch = on_batch
        #: called with the number of queued requests when it changes (None: nobody listens)
        self.on_queue: Callable[[int], None] | None = None
        self._waiting: deque[_Waiting] = deque()
        self._arrived = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="megamoe-batcher")

    async def stop(self) -> None:
        """Run what is queued, then end the loop."""
        self._stopping = True
        self._arrived.set()
        if self._task is not None:
            await self._task
        if self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)
        if self._completer is not None:
            self._completer.shutdown(wait=True)

    @property
    def queued_requests(self) -> int:
        return len(self._waiting)

    async def submit(self, request: ModelRequest) -> BatchResult:
        if self._stopping:
            raise ShuttingDown("server is shutting down")
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(request, future, time.perf_counter()))
        self._arrived.set()
        if self.on_queue is not None:
            self.on_queue(len(self._waiting))
        return await future

    def _ready_tokens(self, key) -> int:
        return sum(w.request.tokens for w in self._waiting if w.request.batch_key == key)

    def _take_batch(self) -> list[_Waiting]:
        head = self._waiting[0]
        key = head.request.batch_key
        batch, kept, tokens = [], deque(), 0
        for waiting in self._waiting:
            fits = not batch or tokens + waiting.request.tokens <= self.max_batch_tokens
            if waiting.request.batch_key == key and fits:
                batch.append(waiting)
                tokens += waiting.request.tokens
            else:
                kept.append(waiting)
        self._waiting = kept
        if self.on_queue is not None:
            self.on_queue(len(kept))
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._waiting:
                if self._stopping:
                    return
                self._arrived.clear()
                await self._arrived.wait()
            if self._finish is not None:
                # a free launch slot first: while the device is busy, the batch keeps growing
                if self._slots is None:
                    self._slots = asyncio.Semaphore(self._max_in_flight)
                await self._slots.acquire()
            head = self._waiting[0]
            deadline = head.enqueued_s + self.queue_delay_s
            while not self._stopping and self._ready_tokens(head.request.batch_key) < self.max_batch_tokens:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            batch = [w for w in self._take_batch() if not w.future.done()]
            if not batch:
                if self._finish is not None:
                    self._slots.release()
                continue
            started = time.perf_counter()
            requests = [w.request for w in batch]
            if self._finish is not None:
                try:
                    launched = await loop.run_in_executor(self._executor, self._run_batch, requests)
                except Exception as exc:  # the device failed: every caller in the batch hears why
                    self._slots.release()
                    self._fail(batch, exc)
                    continue
                task = loop.create_task(self._complete(batch, requests, launched, started))
                self._in_flight.add(task)
                task.add_done_callback(self._in_flight.discard)
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self._run_batch, requests)
                if len(outputs) != len(batch):
                    raise RuntimeError(f"batch of {len(batch)} requests produced {len(outputs)} outputs")
            except Exception as exc:  # the device failed: every caller in the batch hears why
                self._fail(batch, exc)
                continue
            self._deliver(batch, requests, outputs, started, time.perf_counter() - started, None)

    @staticmethod
    def _fail(batch: list[_Waiting], exc: BaseException) -> None:
        for waiting in batch:
            if not waiting.future.done():
                waiting.future.set_exception(exc)

    async def _complete(self, batch: list[_Waiting], requests: list[ModelRequest], launched, started: float) -> None:
        try:
            outputs, stages = await asyncio.get_running_loop().run_in_executor(self._completer, self._finish, launched)
            if len(outputs) != len(batch):
                raise RuntimeError(f"batch of {len(batch)} requests produced {len(outputs)} outputs")
        except Exception as exc:  # the device failed: every caller in the batch hears why
            self._fail(batch, exc)
            return
        finally:
            self._slots.release()
        compute_s = stages.get("compute", time.perf_counter() - started)
        self._deliver(batch, requests, outputs, started, compute_s, stages)

    def _deliver(self, batch, requests, outputs, started: float, compute_s: float, stages: dict | None) -> None:
        tokens = sum(r.tokens for r in requests)
        for waiting, output in zip(batch, outputs):
            if waiting.future.done():
                continue
            if isinstance(output, BaseException):  # this request only (a 400 found on the device)
                waiting.future.set_exception(output)
            else:
                waiting.future.set_result(
                    BatchResult(output, started - waiting.enqueued_s, compute_s, len(batch), tokens)
                )
        try:  # metrics must never stop the loop that every caller waits on
            if self._on_batch is not None:
                self._on_batch(len(batch), tokens, compute_s)
            if stages and self._on_stages is not None:
                self._on_stages(stages)
        except Exception:
            log.exception("batch metrics callback failed")
