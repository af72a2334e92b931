"""The Python source :mod:`pardec.metrics.sandbox` runs inside the sandboxed interpreter before and around the
program: the audit-hook guard (layer 5) and the runner with the pass-marker protocol (the sandbox's docstring)."""

from __future__ import annotations

# Runs in the child before the program (part of the ``python -c`` source); see the module docstring.
GUARD = r'''
def _pardec_guard():
    import os, sys, types, _posixsubprocess
    # all state is immutable: a traceback of a denial exposes it through the hook's frame
    root = os.path.realpath(os.getcwd())
    denied = frozenset((
        "os.fork", "os.forkpty", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "subprocess.Popen",
        "os.kill", "os.killpg", "signal.pthread_kill", "os.link", "os.symlink",
        "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.cdata", "resource.setrlimit", "resource.prlimit",
        "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
        "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    ))
    denied_imports = frozenset(("_posixsubprocess",))
    # event -> ((index of a path argument, index of its dir_fd argument or None), ...)
    path_args = types.MappingProxyType({
        "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.rename": ((0, 2), (1, 3)),
        "os.truncate": ((0, None),), "os.utime": ((0, 3),), "os.chmod": ((0, 2),), "os.chown": ((0, 3),),
        "os.setxattr": ((0, None),), "os.removexattr": ((0, None),), "shutil.rmtree": ((0, 1),),
        "sqlite3.connect": ((0, None),),
    })
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def deny(what):
        raise PermissionError(f"sandbox: {what} is not allowed")

    def check_path(event, path, dir_fd):
        if isinstance(path, int):  # an already-open file descriptor: its opening was checked
            return
        path = os.fsdecode(os.fspath(path))
        base = os.readlink(f"/proc/self/fd/{dir_fd}") if isinstance(dir_fd, int) and dir_fd >= 0 else os.getcwd()
        real = os.path.realpath(os.path.join(base, path))
        if real != root and not real.startswith(root + os.sep) and real != os.devnull:
            deny(f"{event} {path!r} (outside the sandbox directory)")

    def hook(event, args):
        if event in denied:
            deny(event)
        elif event == "import" and args[0] in denied_imports:
            deny(f"import {args[0]}")
        elif event == "ctypes.dlopen" and args[0] is not None:  # CDLL(None), done by `import ctypes`, is fine
            deny(f"ctypes.dlopen({args[0]!r})")
        elif event == "open" and (set(args[1] or "") & set("wax+") or (args[2] or 0) & write_flags):
            check_path("writing to", args[0], None)
        elif event in path_args:
            for i, j in path_args[event]:
                check_path(event, args[i], None if j is None else args[j])

    def fork_exec(*args, **kwargs):
        deny("_posixsubprocess.fork_exec (process creation)")

    _posixsubprocess.fork_exec = fork_exec
    sys.addaudithook(hook)


_pardec_guard()
del _pardec_guard
'''

# Runs the program as __main__; with a ``then`` expression, the pass-marker protocol of the module docstring.
RUN = r'''
def _pardec_run(then):
    import os, sys
    with open("main.py", encoding="utf-8") as f:
        code = compile(f.read(), "main.py", "exec")
    ns = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    if then is None:
        exec(code, ns)
        return
    ctl = int(os.environ.pop("__CTL_ENV__"))
    exec(code, ns)
    sys.settrace(None)
    sys.setprofile(None)
    if len(os.listdir("/proc/self/task")) != 1:
        raise RuntimeError("sandbox: threads still running after the module code; not checked")
    os.write(ctl, b"ready\n")
    secret = sys.stdin.buffer.readline().strip()
    eval(then, ns)
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(ctl, b"returned " + secret + b"\n")
    os._exit(0)


_pardec_run(__THEN__)
'''
