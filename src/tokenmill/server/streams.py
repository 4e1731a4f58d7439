"""Where the engine side's items reach the HTTP handlers: one asyncio queue per request, filled from
another thread (the engine thread, or the thread that reads the engine process's pipe) with one
``loop.call_soon_threadsafe`` per engine step and event loop, never one per token."""

import asyncio
import logging
from collections import defaultdict

from tokenmill.server.engine_messages import StreamItem

logger = logging.getLogger(__name__)


class RequestStream:
    """Where the engine side delivers one HTTP request's items; read on the event loop that made it."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue[StreamItem] = asyncio.Queue()


class Deliveries:
    """Items for the event loops' queues, handed over with one ``call_soon_threadsafe`` per loop."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, StreamItem]]] = defaultdict(
            list
        )

    def add(self, stream: RequestStream, item: StreamItem) -> None:
        self._by_loop[stream.loop].append((stream, item))

    def send(self) -> None:
        for loop, items in self._by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is closed: the server is gone
                logger.debug("dropping %d items for a closed event loop", len(items))
        self._by_loop.clear()


def _put_all(items: list[tuple[RequestStream, StreamItem]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)
