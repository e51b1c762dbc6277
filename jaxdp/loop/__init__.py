"""`jaxdp.fit`: the whole training loop (resolve -> restore -> run -> finish) and its periodic work.

Submodules load on first use (PEP 562): importing the package imports nothing else.
"""

from jaxdp import moved

__getattr__ = moved.package(__name__, 'jaxdp.loop.trainer')
