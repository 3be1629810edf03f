import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


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
