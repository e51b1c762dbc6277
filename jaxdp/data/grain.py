"""A grain pipeline as `jaxdp.fit`'s data, with exact resume.

    ds = grain.MapDataset.source(records).shuffle(seed=0).map(to_arrays).batch(64)
    jaxdp.fit(loss_fn, params, tx, ds, steps=1000, checkpoint_dir="/tmp/run")            # random access
    jaxdp.fit(loss_fn, params, tx, grain.DataLoader(...), steps=1000, checkpoint_dir=...)  # an iterator

A `grain.MapDataset` (of batches) is random access: batch `step` is `ds[step]`, a pure function of
the step like every jaxdp dataset, so a resumed run reads exactly the batches an uninterrupted one
would with nothing to save. A grain iterator (a `DataLoader`, an `IterDataset`, or an iterator of
either: anything whose iterator has `get_state` / `set_state`) is read in order; its state before each
step's batch is kept for the last `KEEP_STATES` steps, and a checkpoint of step N stores the state
before batch N (`Checkpointer.data_state`, in the checkpoint's meta), whatever the prefetcher read
ahead. A resumed run sets the iterator to that state before it reads batch N.

`adapt` turns what fit was given into `data(step)` (anything that is not grain passes through unchanged),
and `attach` gives an iterator's state slot to the checkpointer.
"""

from __future__ import annotations

import json
import threading
from typing import Any

KEEP_STATES = 256  # iterator states kept: prefetching and the compression controller read a few steps ahead
META_KEY = "data_iterator"  # the checkpoint meta's entry


def adapt(data: Any) -> Any:
    """`data` as fit takes it: a grain MapDataset as `lambda step: ds[step]`, a grain iterator as an
    `IteratorData`, anything else as it is. Imports grain only when `data` comes from it."""
    module = type(data).__module__ or ""
    if not module.startswith("grain"):
        return data
    import grain

    if isinstance(data, grain.MapDataset):
        return MapData(data)
    iterator = iter(data)
    if not (hasattr(iterator, "get_state") and hasattr(iterator, "set_state")):
        return data  # an iterable without state: read in order, skipped on resume (fit's iterable path)
    return IteratorData(iterator)


def attach(data: Any, checkpointer: Any) -> None:
    """Store a grain iterator's state in `checkpointer`'s checkpoints, and resume it from the one it restores."""
    if checkpointer is not None and isinstance(data, IteratorData):
        data.attach(checkpointer)


class MapData:
    """Batch `step` of a grain MapDataset of batches: `ds[step]`."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __call__(self, step: int) -> Any:
        from jaxdp.errors import InputError

        if step >= len(self.dataset):
            raise InputError(f"fit: the grain MapDataset has {len(self.dataset)} batches, too few for step {step}; "
                             f"give at least `steps` (e.g. .repeat() before .batch())", argument="data")
        return self.dataset[step]


class IteratorData:
    """A stateful grain iterator as `data(step)`: steps are read in order (a step read already comes
    from a small cache), and its state before each step's batch is kept for `state_at`."""

    def __init__(self, iterator: Any):
        self.iterator, self.position = iterator, 0
        self.cache: dict[int, Any] = {}
        self.states: dict[int, Any] = {}
        self.checkpointer: Any = None  # set by `attach`: its `restored_meta` holds the state to resume from
        self.resumed_from: Any = None
        self.lock = threading.Lock()  # the prefetcher's thread and the loop may both ask

    def attach(self, checkpointer: Any) -> None:
        """Save the iterator's state with every checkpoint, and resume from the one `checkpointer` restores."""
        checkpointer.data_state = lambda step: {META_KEY: self.state_at(step)}
        self.checkpointer = checkpointer

    def __call__(self, step: int) -> Any:
        from jaxdp.errors import InputError

        with self.lock:
            meta = getattr(self.checkpointer, "restored_meta", None) or {}
            if meta.get(META_KEY) is not None and meta is not self.resumed_from and step == meta["step"]:
                try:  # resumed: continue where the checkpoint was
                    self.iterator.set_state(_decode(meta[META_KEY]))
                except (ValueError, KeyError, TypeError) as err:
                    raise InputError(f"fit: the checkpoint's grain iterator state does not fit this pipeline "
                                     f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); give the "
                                     f"pipeline it was saved with, or another checkpoint directory", argument="data") from None
                self.position, self.resumed_from = step, meta
                self.cache.clear()
            if step in self.cache:
                return self.cache[step]
            if step < self.position:
                raise InputError(f"fit: a grain iterator cannot go back to step {step}; give a grain MapDataset or "
                                 f"a function data(step)", argument="data")
            while self.position <= step:  # (a resume without a saved state: skip what the steps before it read)
                self.states[self.position] = self.iterator.get_state()
                try:
                    self.cache[self.position] = next(self.iterator)
                except StopIteration:
                    raise InputError(f"fit: the grain iterator ran out at step {self.position}; give at least `steps` "
                                     f"batches (e.g. more epochs)", argument="data") from None
                self.position += 1
                for old in [s for s in self.cache if s < self.position - 16]:
                    del self.cache[old]
                for old in [s for s in self.states if s < self.position - KEEP_STATES]:
                    del self.states[old]
            return self.cache[step]

    def state_at(self, step: int) -> Any:
        """The iterator's state before batch `step` (the one a checkpoint of step `step` resumes from), as JSON."""
        with self.lock:
            state = self.states.get(step, self.iterator.get_state() if step == self.position else None)
        if state is None:
            raise RuntimeError(f"the grain iterator's state at step {step} is no longer kept (it is at step {self.position})")
        return _encode(state)


def _encode(state: Any) -> Any:
    """A grain state in JSON: a DataLoader's is bytes (JSON text), a dataset iterator's a dict."""
    return {"bytes": state.decode()} if isinstance(state, bytes) else {"value": json.loads(json.dumps(state))}


def _decode(saved: Any) -> Any:
    return saved["bytes"].encode() if "bytes" in saved else saved["value"]
