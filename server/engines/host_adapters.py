"""Skills' adapters read from the store off the engine's loop, and kept on the host ready to upload to the bank.

A read starts when a request is submitted, which is when routing has decided its skills, so by the time the
loop admits the request its adapter is usually on the host already; the loop never waits on the store while
other rows decode (a remote store's read takes a network round trip). An adapter evicted from the bank keeps
its host copy here, so a skill that comes back soon is uploaded without reading the store again. Reads run on
one helper thread; host copies are kept in least-recently-used order, at most `capacity` of them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from queue import SimpleQueue

from skillpool.lora.adapter import LoRAAdapter
from skillpool.runtime.openmp import as_helper_thread

from .protocol import AdapterLoader


class HostAdapters:
    """Background reads and host copies of adapters, by version key. Thread-safe: `fetch` is called by whoever
    submits a request, the rest by the engine's loop."""

    def __init__(self, capacity: int, on_ready: Callable[[], None] | None = None) -> None:
        """`capacity`: host copies kept at most (reads in flight aside); `on_ready`: called on the reading thread
        when a read ends, so that a loop with nothing else to do wakes for it."""
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity, self.on_ready = capacity, on_ready
        self._lock = threading.Lock()
        self._reads: dict[str, Future[LoRAAdapter]] = {}  # in flight, or ended and not yet taken
        self._copies: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        # a daemon thread, not an executor's: a read that hangs on an unreachable store must not hold up exit
        self._queue: SimpleQueue[tuple[Future[LoRAAdapter], AdapterLoader] | None] = SimpleQueue()
        self._closed = False
        threading.Thread(target=self._read_loop, name="skillpool-adapter-read", daemon=True).start()
        self.reads = 0  # reads started so far

    def fetch(self, key: str, load: AdapterLoader, ahead: bool = False) -> None:
        """Start reading `key` unless it is on the host or being read. `ahead`: a read for a request still queued,
        skipped while `capacity` reads are pending (adapters read ahead for a long queue would hold
        memory); the loop fetches again, without that bound, when the request's turn comes."""
        with self._lock:
            if key in self._copies or key in self._reads:
                return
            if ahead and len(self._reads) >= self.capacity:
                return
            if self._closed:  # the engine is stopping, and its loop reads nothing more
                return
            future: Future[LoRAAdapter] = Future()
            self._queue.put((future, load))
            self._reads[key] = future
            self.reads += 1
        if self.on_ready is not None:
            on_ready = self.on_ready
            future.add_done_callback(lambda _: on_ready())

    def take(self, key: str) -> LoRAAdapter | None:
        """The adapter for `key` if it is on the host (it stays there, most recently used); None while its read is
        in flight or none was started. A read that failed raises its error here, once: the next fetch reads again."""
        with self._lock:
            if key in self._copies:
                self._copies.move_to_end(key)
                return self._copies[key]
            future = self._reads.get(key)
            if future is None or not future.done():
                return None
            del self._reads[key]
            adapter = future.result()  # a failed read raises here, and is forgotten
            self._keep(key, adapter)
            return adapter

    def loading(self, key: str) -> bool:
        with self._lock:
            return key in self._reads and not self._reads[key].done()

    def drop(self, key: str) -> None:
        """Forget `key` (a retired version): its host copy, and a read's result when it ends."""
        with self._lock:
            self._copies.pop(key, None)
            future = self._reads.pop(key, None)
        if future is not None:
            future.cancel()

    def _keep(self, key: str, adapter: LoRAAdapter) -> None:
        self._copies[key] = adapter
        self._copies.move_to_end(key)
        while len(self._copies) > self.capacity:
            self._copies.popitem(last=False)

    def __len__(self) -> int:
        """Host copies kept."""
        with self._lock:
            return len(self._copies)

    def _read_loop(self) -> None:
        as_helper_thread()
        while (item := self._queue.get()) is not None:
            future, load = item
            if not future.set_running_or_notify_cancel():  # dropped before its turn
                continue
            try:
                future.set_result(load())
            except BaseException as e:  # the request that needs it fails with this error (take)
                future.set_exception(e)

    def close(self) -> None:
        """Stop reading: reads not yet started are cancelled, and the thread ends after the current one."""
        with self._lock:
            self._closed = True
            pending = list(self._reads.values())
        for future in pending:
            future.cancel()
        self._queue.put(None)
