"""The update rules: per-device gradients -> the exchange -> optax. The train step and its state, local
steps (DiLoCo), ZeRO-1, every-step overlap (delayed) and host-paced rounds.

Submodules load on first use (PEP 562): importing the package imports nothing else.
"""

from jaxdp import moved

__getattr__ = moved.package(__name__, 'jaxdp.step.train_step')
