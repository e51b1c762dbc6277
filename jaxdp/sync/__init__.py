"""Where the gradient is averaged: the collectives (psum, the ring, hierarchical, host), the codecs that
compress what crosses, the exchange that combines the two, the spec of a run's sync choices with the one
table of which combine, and the cost model and controller behind `auto`.

Submodules load on first use (PEP 562): importing the package imports nothing else.
"""

from jaxdp import moved

__getattr__ = moved.package(__name__, ('jaxdp.sync.collectives', 'jaxdp.sync.hierarchy'))
