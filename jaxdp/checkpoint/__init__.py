"""Checkpoints: the orbax Checkpointer, reading a run back without a template (load_params, load_model),
the portable layout, what a resume must share, when to save, and the directory lock.

Submodules load on first use (PEP 562): importing the package imports nothing else.
"""

from jaxdp import moved

__getattr__ = moved.package(__name__, 'jaxdp.checkpoint.checkpointer')
