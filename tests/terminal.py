"""Run the `weightshare` command on a pseudo-terminal, as a user at a terminal of a given size sees it."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

# colour, cursor moves and line erasing (a spinner redraws itself with them)
ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_in_terminal(args: list[str], env: dict[str, str], columns: int = 80, timeout: float = 120) -> tuple[int, str]:
    """stdout and stderr on one pseudo-terminal of ``columns`` columns; returns the exit code and what was shown,
    escape codes left in."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightshare", *args],
        stdout=follower,
        stderr=follower,
        env={**os.environ, "TERM": "xterm-256color", "COLUMNS": str(columns), **env},
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    code = proc.wait(timeout=timeout)
    os.close(leader)
    return code, b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")
