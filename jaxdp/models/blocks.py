"""A model's stack of identical blocks, run by the step that trains it.

A model whose forward pass is embeddings, then `L` blocks of one shape, then a head can hand the
blocks to the step:

    if blocks.active():
        x = blocks.run(x, [{"qkv": f"qkv_{i}", "fc": f"fc_{i}", ...} for i in range(L)],
                       lambda p, x: Block().apply({"params": p}, x))
    else:
        for i in range(L): ...   # the model's own loop (init, evaluation, every other step)

`layers[i]` names block i's parameters: a key of the block's own tree -> the top-level name of the
parameter in the model's tree (every block the same keys and shapes). `block(p, x)` applies one
block with parameters `p` keyed like that. Nothing else changes: the model's parameter tree, its
checkpoints and its numbers are those of its own loop.

Who runs them: `--shard-params` (jaxdp/step/fsdp.py) runs the blocks in a `lax.scan` that gathers
one block's parameter slices at a time (and again, rematerialised, in the backward pass), so the
step's peak holds one block's whole parameters rather than the whole model's. The built-in GPT
(jaxdp/models/builtin.py) calls `run`; a user's model may too.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

Runner = Callable[[Any, list[dict[str, str]], Callable[[Any, Any], Any]], Any]

_RUNNER: contextvars.ContextVar[Runner | None] = contextvars.ContextVar("jaxdp_blocks_runner", default=None)


def active() -> bool:
    """Whether a step runs the blocks (the model then calls `run` instead of its loop)."""
    return _RUNNER.get() is not None


def run(x: Any, layers: list[dict[str, str]], block: Callable[[Any, Any], Any]) -> Any:
    """The blocks named by `layers`, applied in order to `x` by the active runner."""
    runner = _RUNNER.get()
    if runner is None:
        raise RuntimeError("jaxdp.models.blocks.run outside a step that runs blocks: test blocks.active() first")
    return runner(x, layers, block)


@contextlib.contextmanager
def running(runner: Runner) -> Iterator[None]:
    """Within: models that call `run` have their blocks applied by `runner(x, layers, block)`."""
    token = _RUNNER.set(runner)
    try:
        yield
    finally:
        _RUNNER.reset(token)
