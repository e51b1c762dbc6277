"""Eight simulated CPU devices for every test, set once before JAX starts its backend."""

import os
import tempfile

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

# One persistent compilation cache for the whole session (in-process runs and every CLI subprocess,
# which inherit the environment), never the user's own ~/.cache.
os.environ.setdefault("JAXDP_COMPILE_CACHE", os.path.join(tempfile.gettempdir(), f"jaxdp-test-cache-{os.getuid()}"))

# jaxdp's bytecode, written once for the session by the controlling process: the suite starts a few
# hundred Python processes that import jaxdp, and where PYTHONDONTWRITEBYTECODE is set (as on this
# project's machines) each compiled jaxdp's modules from source again: 0.35 s of a process's 3.3 s
# of CPU for `python -m jaxdp.train --steps 1`. Processes only read it; the variable still holds.
if "PYTEST_XDIST_WORKER" not in os.environ:
    import compileall

    compileall.compile_dir(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxdp"), quiet=2)

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxdp.cluster import runtime  # noqa: E402

# The same cache for the tests that train in this process, from the first one on (before, only
# after a test had run jaxdp.train's main in-process, which enables it for the rest of the worker).
runtime.enable_compile_cache(os.environ["JAXDP_COMPILE_CACHE"])


@pytest.fixture(scope="session")
def devices():
    assert len(jax.devices()) == 8, "conftest must set 8 simulated devices before JAX starts"
    return jax.devices()
