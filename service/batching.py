"""Dynamic batching: concurrent requests share one forward on the device.

The first request waiting opens a window of ``queue_delay_s``; requests that
arrive in it and can share one forward call (same dtype and routing mode, see
``ModelRequest.batch_key``) join until ``max_batch_tokens`` is reached. The rows
are stacked, run once, and split back in the same order, so each caller gets
exactly its own rows. Forward calls run one at a time on a single device
thread; while one runs, the next batch gathers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import Executor
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
    ):
        self._run_batch = run_batch
        self._executor = executor
        self.max_batch_tokens = max_batch_tokens
        self.queue_delay_s = queue_delay_s
        self._on_batch = on_batch
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

    @property
    def queued_requests(self) -> int:
        return len(self._waiting)

    async def submit(self, request: ModelRequest) -> BatchResult:
        if self._stopping:
            raise ShuttingDown("server is shutting down")
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(request, future, time.perf_counter()))
        self._arrived.set()
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
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._waiting:
                if self._stopping:
                    return
                self._arrived.clear()
                await self._arrived.wait()
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
                continue
            started = time.perf_counter()
            requests = [w.request for w in batch]
            try:
                outputs = await loop.run_in_executor(self._executor, self._run_batch, requests)
                if len(outputs) != len(batch):
                    raise RuntimeError(f"batch of {len(batch)} requests produced {len(outputs)} outputs")
            except Exception as exc:  # the device failed: every caller in the batch hears why
                for waiting in batch:
                    if not waiting.future.done():
                        waiting.future.set_exception(exc)
                continue
            compute_s = time.perf_counter() - started
            tokens = sum(r.tokens for r in requests)
            for waiting, output in zip(batch, outputs):
                if not waiting.future.done():
                    waiting.future.set_result(
                        BatchResult(output, started - waiting.enqueued_s, compute_s, len(batch), tokens)
                    )
            if self._on_batch is not None:
                try:  # metrics must never stop the loop that every caller waits on
                    self._on_batch(len(batch), tokens, compute_s)
                except Exception:
                    log.exception("batch metrics callback failed")
