"""A JAX process inside a run: who it is (detect), jax.distributed and gloo, admission, agreement,
the coordination service, lost and stalled peers, preemption, process-wide settings.

Submodules load on first use (PEP 562): importing the package imports nothing else.
"""

from jaxdp import moved

__getattr__ = moved.package(__name__, 'jaxdp.cluster.detect')
