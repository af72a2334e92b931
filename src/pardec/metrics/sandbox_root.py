"""The sandbox's private root and user (layer 1 of :mod:`pardec.metrics.sandbox`): what bubblewrap mounts, and
which host user the program runs as.

**The root** is built in memory; nothing of the host is there unless listed here. Read-only: the OS's programs and
libraries (:data:`SYSTEM_PATHS`: ``/usr``, the ``/bin`` and ``/lib*`` links into it, the dynamic linker's cache),
the interpreter (:func:`interpreter_paths`: the real directories of the executable, its prefixes, standard library
and site-packages, and every symlink on the way to them), and the caller's ``ro_paths``. Writable: the program's own
working directory. Fresh: ``/dev``, ``/proc`` (of its PID namespace) and an empty ``/tmp``. So no ``/etc`` (no
passwd, shadow, resolv.conf), no ``/home``, ``/root``, ``/work``, no project directory and no checkout. Every
directory made on the way to a bind is 0755 (bubblewrap would copy the host's mode: ``/root``'s 0700 would lock the
unprivileged user out of an interpreter installed under it).

**The user**: started by an unprivileged user, bubblewrap maps ``nobody`` (65534) inside to that user. Started by
root, bubblewrap's own mapping would make the program's ``nobody`` the host's root (every root-owned file it can see
readable, as found: ``/etc/shadow``); instead :func:`user_namespace` creates the user namespace with two mappings,
0 -> 0 (bubblewrap's mounts) and 65534 -> 65534, bubblewrap joins it (``--userns``), and ``setpriv`` starts the
program as 65534 with no capabilities and no way back (``--no-new-privs``): the host's ``nobody``.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

#: the OS's own read-only software the interpreter links against, bound as it is (a symlink re-created as one)
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")
NOBODY = 65534


def interpreter_paths() -> list[str]:
    """The paths the sandboxed interpreter needs, as this process names them (symlinks not resolved): the
    executable, the prefixes, the standard library and site-packages."""
    paths = [sys.executable, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    sc = sysconfig.get_paths()
    paths += [sc[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if sc.get(k)]
    return [p for p in paths if p]


def resolve_links(path: str) -> tuple[str, list[tuple[str, str]]]:
    """``path`` resolved like :func:`os.path.realpath`, and every symlink met on the way: (its location, its target
    as written), in the order the kernel follows them."""
    links: list[tuple[str, str]] = []
    parts = list(Path(os.path.join(os.getcwd(), path)).parts[1:])
    cur = "/"
    while parts:
        name = parts.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, name)
        if not os.path.islink(nxt) or len(links) >= 40:  # 40: the kernel's limit on links in one lookup
            cur = nxt
            continue
        target = os.readlink(nxt)
        links.append((nxt, target))
        parts = list(Path(target).parts[1:] if os.path.isabs(target) else Path(target).parts) + parts
        if os.path.isabs(target):
            cur = "/"
    return cur, links


def _under(p: str, dirs) -> bool:
    return any(p == d or p.startswith(d.rstrip("/") + "/") for d in dirs)


def visible_paths(shown: list[str], ro_paths: tuple[str, ...] = ()) -> tuple[list[str], list[tuple[str, str]]]:
    """What the private root must add to the ``shown`` paths (bound already) for the interpreter and ``ro_paths``
    to work: the real paths to bind read-only (one per tree), and the symlinks (location, target) on the way to them
    to re-create. Symlinks are resolved first, so a virtualenv reached through a link (``/work/.venv -> /tmp/venv``)
    gets its real directory bound and the link re-created."""
    binds: set[str] = set()
    links: dict[str, str] = {}
    for p in [*interpreter_paths(), *map(os.path.abspath, ro_paths)]:
        real, chain = resolve_links(p)
        if p == sys.executable:  # its directory: the interpreter may look beside itself (pyvenv.cfg, libs)
            real = os.path.dirname(real)
        if not _under(real, shown) and os.path.exists(real):
            binds.add(real)
        links.update((link, target) for link, target in chain if not _under(link, shown))
    binds = {b for b in binds if not _under(os.path.dirname(b), binds)}
    return sorted(binds), sorted((k, v) for k, v in links.items() if not _under(k, binds))


def root_args(work: Path, ro_paths: tuple[str, ...] = ()) -> list[str]:
    """bubblewrap's mount arguments for the private root, ``work`` its one writable directory."""
    args = ["--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/tmp"]
    made = {"/", "/dev", "/proc", "/tmp"}

    def dirs_to(path: str) -> list[str]:  # its missing ancestors, 0755 (not the host's mode)
        out = []
        for parent in reversed(Path(path).parents):
            if str(parent) not in made:
                made.add(str(parent))
                out += ["--perms", "0755", "--dir", str(parent)]
        return out

    def bind(flag: str, src: str, dest: str) -> list[str]:
        made.add(dest)
        return [*dirs_to(dest), flag, src, dest]

    shown = []
    for p in SYSTEM_PATHS:
        if os.path.islink(p):
            args += [*dirs_to(p), "--symlink", os.readlink(p), p]
            made.add(p)
        elif os.path.exists(p):
            args += bind("--ro-bind", p, p)
            shown.append(p)
    binds, links = visible_paths(shown, ro_paths)
    for p in binds:
        args += bind("--ro-bind", p, p)
    for link, target in links:
        args += [*dirs_to(link), "--symlink", target, link]
        made.add(link)
    return [*args, *bind("--bind", str(work), str(work)), "--chdir", str(work)]


def user_namespace() -> tuple[list[str], list[str], tuple[int, ...]]:
    """(bubblewrap's user arguments, the program's argv prefix, the fds to pass) that run the program as an
    unprivileged host user: bubblewrap's own ``--uid`` mapping when this process is not root; as root, a user
    namespace mapping 0 -> 0 and 65534 -> 65534 that bubblewrap joins (one per process), and ``setpriv`` to 65534."""
    if os.geteuid() != 0:
        return ["--unshare-all", "--uid", str(NOBODY), "--gid", str(NOBODY), "--cap-drop", "ALL"], [], ()
    fd = _mapped_namespace()
    return (["--userns", str(fd), "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup",
             "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"],
            [setpriv(), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--no-new-privs", "--"], (fd,))


@functools.cache
def setpriv() -> str:
    path = shutil.which("setpriv", path="/usr/bin:/bin")
    if path is None:
        raise FileNotFoundError("setpriv (util-linux) not found: as root the sandbox needs it to run the program as "
                                "the host's nobody")
    return path


@functools.cache
def _mapped_namespace() -> int:
    """An fd of a new user namespace whose uid and gid maps are ``0 0 1`` and ``65534 65534 1`` (written by this
    process, root in the parent namespace); the fd keeps it alive after its first process is gone, and every run of
    this process joins it (made once: a namespace holds no state of a run)."""
    holder = subprocess.Popen(["unshare", "--user", "--", "sleep", "30"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        mine, deadline = os.readlink("/proc/self/ns/user"), time.monotonic() + 10
        while os.readlink(f"/proc/{holder.pid}/ns/user") == mine:
            if holder.poll() is not None or time.monotonic() > deadline:
                why = holder.stderr.read().decode(errors="replace").strip() if holder.poll() is not None else "timeout"
                raise OSError(f"unshare --user did not make a user namespace ({why[:200]})")
            time.sleep(0.002)
        maps = f"0 0 1\n{NOBODY} {NOBODY} 1\n"
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{holder.pid}/{name}", "w") as f:
                f.write(maps)
        return os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        holder.kill()
        holder.wait()
