"""The launcher process (`python -m jaxdp.launch`): local workers, the multi-node rendezvous, the warm
start for restarts. Imports no JAX.

Submodules load on first use (PEP 562): importing the package imports nothing else.
"""

from jaxdp import moved

__getattr__ = moved.package(__name__)
