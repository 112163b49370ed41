"""Running the ``placement`` command as a user does: a subprocess in a folder of the test's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: the venv's ``placement`` script (``python -m placement.cli`` where it is not installed)
SCRIPT = Path(sys.executable).with_name("placement")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``placement *args`` in ``cwd``; its exit status, stdout and stderr (text)."""
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "placement.cli"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [*command, *args], cwd=cwd, capture_output=True, text=True, timeout=300, check=False, env=env
    )
