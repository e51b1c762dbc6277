"""Where the codecs lived before they became a package (jaxdp/sync/codecs/): every name still
resolves here, with a DeprecationWarning, until jaxdp 0.2.0 (jaxdp/moved.py, REMOVED_IN).

    from jaxdp.sync.codecs import parse               # the new home (the table, JAX-free)
    from jaxdp.sync.codecs.powersgd import PowerSGD   # one file per family
"""

from jaxdp.moved import forwarder

_HOMES = {
    **dict.fromkeys(("Compressor", "CompressionState", "Wire", "bytes_sent", "uncompressed_bytes"), "jaxdp.sync.codecs.base"),
    **dict.fromkeys(("NoCompression", "Bf16"), "jaxdp.sync.codecs.plain"),
    **dict.fromkeys(("Quantized", "QUANT_BLOCK"), "jaxdp.sync.codecs.quantized"),
    **dict.fromkeys(("PowerSGD", "orthonormalize", "matrix_view", "DEFAULT_MIN_RATE", "ORTHO_EPS"),
                    "jaxdp.sync.codecs.powersgd"),
    **dict.fromkeys(("parse", "SPEC_HELP"), "jaxdp.sync.codecs"),
    # names that lived here before the cost model and the train-state adapter had modules of their own
    **dict.fromkeys(("CommModel", "fit_comm_model", "ladder", "plan", "relative_error", "weaker", "guard", "DEFAULT_RANKS",
                     "TARGET_COMM_FRACTION", "MIN_STEP_GAIN", "GUARD_THRESHOLD", "GUARD_WINDOW"), "jaxdp.sync.costmodel"),
    "STATE_NAME": "jaxdp.sync.exchange", "AUTO": "jaxdp.registry",
}

__getattr__ = forwarder(__name__, _HOMES)
