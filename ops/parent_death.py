"""Children that die with their parent: a `tapioca train` killed with SIGKILL (or by the
OOM killer) cannot stop its broker and roles itself, so each child asks the kernel to
signal it when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``).

:func:`guarded` prefixes a command with a tiny Python stub (``python -I -S``: no site,
no Tapioca import, a few milliseconds) that sets the parent-death signal, checks that
the parent is still the one that started it (else the parent died before the signal was
armed), and ``exec``s the real command: the signal survives ``execve`` (for
non-setuid programs), so it works for the Tansu binary as for Python roles.

The kernel sends the signal when the *thread* that forked the child exits, so the
launcher starts its children from its main thread. Elsewhere than Linux the command is
returned as it is (process groups still let a live launcher stop everything).
"""

from __future__ import annotations

import os
import signal
import sys

# argv: PARENT_PID SIGNAL PROGRAM [ARGS...]
_GUARD = """\
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(1, int(sys.argv[2]), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
    sys.stderr.write('prctl(PR_SET_PDEATHSIG) failed: errno %d\\n' % ctypes.get_errno())
if os.getppid() != int(sys.argv[1]):
    sys.exit(75)  # the parent died before the signal was armed
os.execvp(sys.argv[3], sys.argv[3:])
"""


def supported() -> bool:
    return sys.platform.startswith("linux")


def guarded(cmd: list[str], sig: int = signal.SIGTERM, parent_pid: int | None = None) -> list[str]:
    """``cmd`` run so that it receives ``sig`` when this process (or ``parent_pid``) dies."""
    if not supported():
        return list(cmd)
    parent = os.getpid() if parent_pid is None else parent_pid
    return [sys.executable, "-I", "-S", "-c", _GUARD, str(parent), str(int(sig)), *cmd]
