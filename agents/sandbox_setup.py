"""The sandbox's launcher: builds the namespaces and the file system the Python tool's
program runs in, then execs the program. Run as a script, never imported by a role:
``python -I -S sandbox_setup.py PLAN_JSON`` (stdlib only, so it works before any path
is set up), by :class:`tapioca.agents.tools.PythonExecutor`.

Consumes the plan (JSON, built by :mod:`tapioca.agents.sandbox`): ``binds`` (host
directories and files shown read-only at the same path), ``work`` (the call's temporary
directory, the only writable path), ``root`` (an empty host directory the private root
is mounted on), ``uid``/``gid`` (the unprivileged ids the program runs as when the
launcher is root), ``argv`` (the program's command line). Emits nothing but the
program's own output; on a failure before the program starts, one line
``tapioca-sandbox: <step>: <error>`` on stderr and exit status 125.

Steps (no daemon, no setuid helper; Linux system calls through ctypes):

1. The launcher ``L`` unshares a mount, PID, network and IPC namespace. As root (with
   ``uid`` mapped in its user namespace) it stays root for the mounts; otherwise it
   first unshares a user namespace too, where it is root mapped to its own uid.
2. ``L`` forks ``C``, PID 1 of the new PID namespace (when C dies the kernel kills
   everything the program forked); ``L`` waits and exits as ``C`` did.
3. ``C`` makes every mount private (nothing propagates to the host), mounts a small
   tmpfs on ``root``, binds each path of ``binds`` read-only into it (plus /dev/null,
   /dev/zero, /dev/full, /dev/random, /dev/urandom), binds ``work`` read-write, mounts a
   fresh /proc of the new PID namespace, makes the tmpfs read-only and pivots into it:
   the host's root is detached, not hidden, so nothing else of the host is reachable.
4. As root, ``C`` drops to ``uid:gid`` (no groups, no capabilities).
5. ``C`` unshares one more user namespace that owns none of the others (so the
   program, root in it, cannot remount or unmount anything) and maps its root to the
   current uid: ``uid`` when the launcher was root, the agent's own uid
   otherwise. ``RLIMIT_NPROC`` is charged per (user namespace, uid) since Linux 5.14,
   and is not enforced for the host's root only: the program's limit counts the
   processes of this call alone, whatever uid the agent runs as.
6. ``C`` execs ``argv`` in ``work``.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME = 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
# pivot_root has no glibc wrapper: its system call number per architecture.
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
DEVICES = ("null", "zero", "full", "random", "urandom")
# statvfs flags a bind mount inherits; a remount that drops one of them is refused
# inside a user namespace (the kernel locks them), so every remount carries them.
_KEEP = ((os.ST_RDONLY, MS_RDONLY), (os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV),
         (os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME),
         (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A step failed. Never leaves this script (it prints the one line and exits 125),
    which cannot import the package's TapiocaError: it runs before any path is set up."""


def _check(ret: int, step: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{step}: {os.strerror(err)} (errno {err})")


def _enc(s: str | None) -> bytes | None:
    return None if s is None else s.encode()


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(_enc(src), _enc(dst), _enc(fstype), ctypes.c_ulong(flags), _enc(data)),
           f"mount {src or ''} on {dst}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _unshare(flags: int, step: str) -> None:
    _check(_libc.unshare(flags), step)


def _map_self(uid: int, gid: int) -> None:
    """Map root of the user namespace just unshared to ``uid``/``gid`` of its parent
    (the only mapping an unprivileged process may write for itself)."""
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"0 {uid} 1")
    _write("/proc/self/gid_map", f"0 {gid} 1")


def _maps(kind: str, value: int) -> bool:
    """Whether ``value`` is mapped in this process's user namespace's ``kind``_map
    ("uid" or "gid"): root can switch to it."""
    with open(f"/proc/self/{kind}_map") as f:
        for line in f:
            inner, _, count = (int(v) for v in line.split())
            if inner <= value < inner + count:
                return True
    return False


def _bind(src: str, dst: str, *, readonly: bool, nodev: bool = True) -> None:
    _mount(src, dst, None, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (MS_RDONLY if readonly else 0) | (MS_NODEV if nodev else 0)
    have = os.statvfs(dst).f_flag
    for st, ms in _KEEP:
        if have & st and not (ms == MS_RDONLY and not readonly):
            flags |= ms
    _mount(None, dst, None, flags)


def _place(root: str, path: str, *, like: str) -> str:
    """Create the mount point for ``path`` inside ``root`` (a directory or an empty file,
    as ``like`` is) and return its full path."""
    dst = root + path
    if os.path.isdir(like):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if not os.path.exists(dst):
            open(dst, "w").close()
    return dst


def build_root(plan: dict) -> None:
    """Steps 3 (the file system) in C, PID 1 of the new PID namespace."""
    root, work = plan["root"], plan["work"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in plan["binds"]:
        if os.path.islink(path) and os.path.dirname(path) == "/":
            # /bin -> usr/bin and the like (merged /usr): the same link, not a second bind.
            os.symlink(os.readlink(path), root + path)
        elif os.path.exists(path):
            _bind(path, _place(root, path, like=path), readonly=True)
    for link in plan.get("links", []):  # /etc/localtime -> /usr/share/zoneinfo/...
        if os.path.islink(link):
            os.makedirs(os.path.dirname(root + link), exist_ok=True)
            os.symlink(os.readlink(link), root + link)
    os.makedirs(root + "/etc", exist_ok=True)
    _write(root + "/etc/passwd", "root:x:0:0:sandbox:/tmp:/bin/sh\n")
    _write(root + "/etc/group", "root:x:0:\n")
    for dev in DEVICES:
        _bind(f"/dev/{dev}", _place(root, f"/dev/{dev}", like=f"/dev/{dev}"), readonly=False, nodev=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"), ("shm", work)):
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(root + "/proc", exist_ok=True)
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _bind(work, _place(root, work, like=work), readonly=False)
    _mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise SetupError(f"pivot_root: unknown system call number on {os.uname().machine}")
    os.chdir(root)
    # pivot_root(".", "."): the old root ends up under the new one and is detached at
    # once, so no path leads back to the host's files.
    _check(_libc.syscall(number, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the host's root")
    os.chdir(work)


def child(plan: dict, as_root: bool) -> None:
    """C: steps 3 to 6; never returns."""
    build_root(plan)
    if as_root:
        os.setgroups([])
        os.setresgid(plan["gid"], plan["gid"], plan["gid"])
        os.setresuid(plan["uid"], plan["uid"], plan["uid"])
        # A uid change clears these two: dumpable lets this process write its own
        # uid_map below; the death signal kills the program if L is killed.
        _check(_libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    uid, gid = os.getuid(), os.getgid()
    _unshare(CLONE_NEWUSER, "unshare the program's user namespace")
    _map_self(uid, gid)
    argv = plan["argv"]
    os.execve(argv[0], argv, plan["env"])


def main() -> int:
    plan = json.loads(sys.argv[1])
    try:
        as_root = os.geteuid() == 0 and _maps("uid", plan["uid"]) and _maps("gid", plan["gid"])
        flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
        if as_root:
            # The program writes its directory as uid:gid (main.py may be 0600 under
            # the agent's umask: its owner changes too).
            for path in [plan["work"], *(os.path.join(plan["work"], n) for n in os.listdir(plan["work"]))]:
                os.chown(path, plan["uid"], plan["gid"], follow_symlinks=False)
            _unshare(flags, "unshare mount, PID, network and IPC namespaces")
        else:
            uid, gid = os.getuid(), os.getgid()
            _unshare(CLONE_NEWUSER | flags, "unshare user, mount, PID, network and IPC namespaces")
            _map_self(uid, gid)
    except (SetupError, OSError) as exc:
        print(f"tapioca-sandbox: {exc}", file=sys.stderr, flush=True)
        return 125
    pid = os.fork()
    if pid == 0:
        try:
            child(plan, as_root)
        except (SetupError, OSError) as exc:
            print(f"tapioca-sandbox: {exc}", file=sys.stderr, flush=True)
        os._exit(125)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):  # die of the same signal, so the executor sees it
        sig = os.WTERMSIG(status)
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status) if not os.WIFSIGNALED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main())
