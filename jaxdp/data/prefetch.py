"""An input pipeline that never makes the devices wait: batches are prepared ahead, on a thread.

    batches = Prefetcher(lambda step: shard_batch(dataset.train_batch(..., step, ...), mesh),
                         start=0, stop=1000, depth=2)
    for step, batch in batches:   # batch `step`, already on the devices
        state, metrics = train_step(state, batch)
    batches.close()

While the devices run step k, a background thread reads the rows of steps k + 1 .. k + depth
from host memory (or a memory-mapped file) and copies them to the devices (`shard_batch`,
`jax.make_array_from_process_local_data`), so the next step's input is resident when it is
dispatched. The batch of a step is still a pure function of the step: prefetching changes when a
batch is made, never which. An error in the thread is raised in the loop, at the step it belongs to.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator


class Prefetcher:
    """Iterate `(step, make_batch(step))` for step in [start, stop), `depth` batches ahead."""

    def __init__(self, make_batch: Callable[[int], Any], start: int, stop: int, depth: int = 2):
        if depth < 0:
            raise ValueError(f"prefetch depth must be 0 or more, got {depth}")
        self._make, self._start, self._stop, self._depth = make_batch, start, stop, depth
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stopping = threading.Event()
        self._thread = None
        if depth:
            self._thread = threading.Thread(target=self._produce, name="jaxdp-prefetch", daemon=True)
            self._thread.start()

    def _produce(self) -> None:
        for step in range(self._start, self._stop):
            try:
                item = (step, self._make(step), None)
            except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised there
                item = (step, None, err)
            while not self._stopping.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stopping.is_set() or item[2] is not None:
                return

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        if self._thread is None:  # depth 0: make each batch when it is needed
            for step in range(self._start, self._stop):
                yield step, self._make(step)
            return
        for _ in range(self._start, self._stop):
            step, batch, err = self._queue.get()
            if err is not None:
                raise err
            yield step, batch

    def close(self) -> None:
        """Stop the thread (it finishes the batch in hand) and drop what it prepared."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
