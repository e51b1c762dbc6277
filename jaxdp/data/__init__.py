"""Data: datasets, the stateless batch order, token streams and tokenizers, the prefetcher, digests.

Submodules load on first use (PEP 562): importing the package imports nothing else.
"""

from jaxdp import moved

__getattr__ = moved.package(__name__, 'jaxdp.data.datasets', warn=False)
