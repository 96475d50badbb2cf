"""What the Python tool's sandbox shows the program, and the command that builds it.

Consumes an interpreter path; emits the launcher's command line
(:mod:`tapioca.agents.sandbox_setup`, run as a script) for one call. No Kafka, no model.

The program sees the system's library directories (``/usr``, ``/bin``, ``/lib*``: the
dynamic loader and the shared libraries Python links to), the dynamic loader's
configuration, and the interpreter's own prefixes (``sys.prefix``, ``sys.base_prefix``,
their exec prefixes and the executable's directory: the standard library and the
site-packages of its virtual environment), all read-only, at the paths they have on
the host; its call's temporary directory read-write; a fresh /proc of its own PID
namespace; and /dev/null, zero, full, random and urandom. Nothing else of the host
exists in its mount namespace: not the run directory, not the agent's home, not
/etc (a two-line passwd and group stand in), not other temporary files.
Paths the interpreter finds through ``.pth`` files outside its prefixes (an editable
install's source tree, where the run directory may live) are deliberately not shown.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess

from ..schemas.errors import ConfigError

# The ids the program runs as when the agent is root: dedicated ones, which own no
# file and run no process on the host (not nobody's 65534: a host daemon running as
# nobody could otherwise reach a call's directory). Below 2**31, which some tools read
# as signed, and above the ranges distributions, sssd and container tools hand out.
SANDBOX_UID = SANDBOX_GID = 2**31 - 3
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d")
# Recreated as the same symbolic link (its target is under /usr).
LINKS = ("/etc/localtime",)
SETUP_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_setup.py")
# The launcher's exit status when it failed before the program started.
SETUP_FAILED = 125


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


@functools.lru_cache(maxsize=None)
def interpreter_paths(python: str) -> tuple[str, ...]:
    """The directories of ``python``'s installation (its prefixes and the executable's
    directory, as given and with symbolic links resolved). Asked of the interpreter once."""
    try:
        out = subprocess.run(
            [python, "-I", "-c", "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, "
             "sys.exec_prefix, sys.base_exec_prefix]))"],
            stdin=subprocess.DEVNULL, capture_output=True, timeout=120, check=True).stdout
        prefixes = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise ConfigError(f"PythonExecutor.python={python!r} does not run ({exc}); "
                          "point it at a Python 3 interpreter") from None
    paths = {os.path.dirname(python), os.path.dirname(os.path.realpath(python))}
    for p in prefixes:
        paths |= {os.path.abspath(p), os.path.realpath(p)}
    return tuple(sorted(paths))


def bind_paths(python: str) -> list[str]:
    """Every host path the program sees read-only, parents before children, none under
    another (a path under a bound directory, or under a top-level link such as
    ``/lib -> usr/lib``, is already visible). A top-level link is kept as a link."""
    if "/" in (os.path.realpath(p) for p in interpreter_paths(python)):
        raise ConfigError(f"the Python tool's interpreter {python} has / as its prefix: showing it "
                          "to the program would show the whole host; use an interpreter installed "
                          "under a directory (a virtual environment, /usr, /opt/...)")
    chosen: list[str] = []
    for path in (*SYSTEM_PATHS, *interpreter_paths(python)):
        real = os.path.realpath(path)
        if not os.path.lexists(path):
            continue
        if os.path.islink(path) and os.path.dirname(path) == "/":
            chosen.append(path)  # /bin -> usr/bin: recreated as the same link
            continue
        if any(_under(path, c) or _under(real, os.path.realpath(c)) for c in chosen):
            continue
        chosen.append(path)
    return chosen


def resolve_python(python: str) -> str:
    """An absolute path for ``python`` (a bare name is looked up on PATH), symbolic
    links kept: a virtual environment is recognised by the path it is started by."""
    found = python if os.sep in python else shutil.which(python)
    if not found:
        raise ConfigError(f"PythonExecutor.python={python!r} is not on PATH")
    return os.path.abspath(found)


def launcher_argv(python: str, *, work: str, root: str, argv: list[str], env: dict[str, str]) -> list[str]:
    """The command that runs ``argv`` (the program, started in ``work``) in the sandbox.
    ``root``: an empty directory the private root file system is mounted on."""
    plan = {"binds": bind_paths(python), "links": list(LINKS), "work": work, "root": root,
            "uid": SANDBOX_UID, "gid": SANDBOX_GID, "argv": argv, "env": env}
    return [python, "-I", "-S", SETUP_SCRIPT, json.dumps(plan)]
