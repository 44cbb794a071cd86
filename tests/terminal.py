"""Run a command with stderr on a pseudo-terminal, as a user's shell would (progress bars draw
only on a terminal)."""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import termios

from .helpers import run_process

__all__ = ["on_a_pty"]


def on_a_pty(args: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, bytes]:
    """Run ``args`` with stderr on a 100-column pseudo-terminal; (result, what stderr got)."""
    primary, secondary = os.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide: tqdm draws nothing
    try:
        r = run_process(args, stdout=subprocess.PIPE, stderr=secondary, env=env, timeout=120)
        os.close(secondary)
        err = b""
        while True:
            try:
                chunk = os.read(primary, 1 << 16)
            except OSError:  # EIO: the other side is closed and drained
                break
            if not chunk:
                break
            err += chunk
    finally:
        os.close(primary)
    return r, err
