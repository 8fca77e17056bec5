"""A request as an engine client takes it (`GenerateRequest`) and the stream of its outputs
(`RequestStream`), fed from another thread or task and read by one asyncio consumer.

Owns the hand-over: in-order delivery with one event-loop wake-up per step (`put_many`), coalescing
of unread outputs, the per-request deadline and the abort on cancel. Knows nothing of how the outputs
are made: a local engine thread (async_engine.py) and a Ray ingress (api/ray/serving.py) both feed it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from vllmlite.engine.exceptions import RequestTimeoutError
from vllmlite.engine.output_processor import coalesce_outputs
from vllmlite.outputs import RequestOutput
from vllmlite.pooling_params import PoolingParams
from vllmlite.sampling_params import SamplingParams


@dataclass
class GenerateRequest:
    """One request, already validated and tokenized by the caller."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # PoolingParams: an embedding request
    priority: int = 0
    cache_salt: str | None = None
    client_id: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)


StreamItem = RequestOutput | BaseException


class RequestStream:
    """One request's RequestOutputs in order, fed from the engine thread; an async iterator.

    Ends after the output with `finished=True`, or by raising the error the engine sent
    (EngineDeadError, RequestAbortedError, ValueError), or RequestTimeoutError at the deadline.
    `cancel()` aborts the request in the engine unless it already ended there.

    Outputs a reader has not taken yet are coalesced into one (`coalesce_outputs`), so a reader that
    falls behind costs the memory of one output, whatever its speed.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 abort: Callable[..., None], timeout: float | None) -> None:
        self.request_id = request_id
        self.loop = loop
        self._abort = abort
        self._items: deque[StreamItem] = deque()
        self._waiter: asyncio.Future | None = None  # while the reader waits for an item
        self._deadline = None if timeout is None else loop.time() + timeout
        self._timeout = timeout
        self.is_finished = False   # the engine has sent its last item
        self._cancel_error: BaseException | None = None  # why cancel() aborts, if not a disconnect
        # Set by a reader that wants only the finished output (a response not streamed): the feeder
        # may then skip the outputs before it, each a wake-up of the event loop for nothing.
        self.final_only = False

    def put(self, item: StreamItem) -> None:
        """Called from the engine thread."""
        put_many([(self, item)])

    def put_nowait(self, item: StreamItem) -> None:
        """Called on the stream's event loop."""
        if self._items and isinstance(item, RequestOutput) and isinstance(self._items[-1], RequestOutput):
            item = coalesce_outputs(self._items.pop(), item)
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def num_unread(self) -> int:
        """Items waiting for the reader (at most one output, then an error)."""
        return len(self._items)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.is_finished:
            raise StopAsyncIteration
        if not self._items:
            await self._wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.is_finished = True
            raise item
        self.is_finished = item.finished
        return item

    async def _wait(self) -> None:
        """Until an item arrives; RequestTimeoutError at the deadline. A bare future (wait_for only
        under a deadline): this runs on the event loop for every token of every stream."""
        self._waiter = self.loop.create_future()
        try:
            if self._deadline is None:
                await self._waiter
            else:
                await asyncio.wait_for(self._waiter, max(self._deadline - self.loop.time(), 0.0))
        except asyncio.TimeoutError:
            self._cancel_error = RequestTimeoutError(f"the request ran past the server's request timeout "
                                                     f"({self._timeout:g} s) and was aborted")
            raise self._cancel_error from None
        finally:
            self._waiter = None

    def cancel(self) -> None:
        """Abort the request in the engine (its blocks are freed within a step) unless it ended."""
        if not self.is_finished:
            self.is_finished = True
            if self._cancel_error is None:
                self._abort(self.request_id)
            else:
                self._abort(self.request_id, self._cancel_error)


def put_many(items: list[tuple[RequestStream, StreamItem]]) -> None:
    """Deliver items from the engine thread with one wake-up of each event loop involved, not
    one per item: a step's outputs for every stream arrive together."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, StreamItem]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_nowait, batch)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more


def _put_nowait(batch: list[tuple[RequestStream, StreamItem]]) -> None:
    for stream, item in batch:
        stream.put_nowait(item)
