"""Models: the built-in Flax models, the user's own (`--model MODULE:ATTR`), Hugging Face GPT-2 in and
out, sampling, and the tasks (loss and held-out metrics) they train on.

Submodules load on first use (PEP 562): importing the package imports nothing else.
"""

from jaxdp import moved

__getattr__ = moved.package(__name__, 'jaxdp.models.builtin', warn=False)
