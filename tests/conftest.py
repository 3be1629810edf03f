import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))
# The model builders live here (model_forms, prepack_samples, genai_model...), not in the package: the children a
# test starts (`python -c` probes measuring PSS) import them too.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))

# Property tests are deterministic: the same examples on every run and every machine (derandomized, no example
# database carried between runs), and no health check that measures time (a loaded CI machine is slow, not wrong).
# `HYPOTHESIS_PROFILE=explore` draws fresh random examples, for hunting by hand.
settings.register_profile(
    "deterministic", derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("explore", max_examples=500, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

# pytest-xdist's workers run with COLUMNS=80 and LINES=24 in their environment; a user's pipe has none (the CLI
# honours COLUMNS where it is set): the children tests start see what a user's would, and a test that wants a width
# sets it.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)

# weightshare.ort remembers verified --prepack blobs in $XDG_CACHE_HOME: the suite (and every child it starts)
# keeps its verdicts in a private directory per run instead of the user's cache.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="weightshare-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)


def run_cli(*args, cwd=None, env=None):
    """Run `weightshare ...` as a user would, in a child process."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("WEIGHTSHARE_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "weightshare", *map(str, args)], capture_output=True, text=True, cwd=cwd, env=full_env
    )


@pytest.fixture
def cli():
    return run_cli
