"""Layer 2 of :mod:`pardec.metrics.sandbox`: the seccomp filter the sandboxed program installs on itself before
any untrusted code (x86-64 and arm64), as classic BPF, and the Python source that installs it."""

from __future__ import annotations

import platform
import struct

# --- seccomp ----------------------------------------------------------------------------------------
# (audit arch, {name: number}) per machine; numbers from the kernel's syscall tables.
_SYSCALLS = {
    "x86_64": (0xC000003E, {
        "clone": 56, "clone3": 435, "fork": 57, "vfork": 58, "execve": 59, "execveat": 322,
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
        "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272, "setns": 308,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "pidfd_send_signal": 424, "pidfd_open": 434, "pidfd_getfd": 438,
        "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "keyctl": 250, "add_key": 248, "request_key": 249,
        "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163, "syslog": 103,
        "settimeofday": 164, "clock_settime": 227, "personality": 135, "name_to_handle_at": 303,
        "open_by_handle_at": 304,
    }),
    "aarch64": (0xC00000B7, {
        "clone": 220, "clone3": 435, "execve": 221, "execveat": 281,
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
        "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "unshare": 97, "setns": 268,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "pidfd_send_signal": 424, "pidfd_open": 434, "pidfd_getfd": 438,
        "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "keyctl": 219, "add_key": 217, "request_key": 218,
        "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "reboot": 142, "swapon": 224, "swapoff": 225, "acct": 89, "syslog": 116,
        "settimeofday": 170, "clock_settime": 112, "personality": 92, "name_to_handle_at": 264,
        "open_by_handle_at": 265,
    }),
}
_CLONE_THREAD = 0x00010000
_X32_BIT = 0x40000000
_EPERM, _ENOSYS = 1, 38
_RET_KILL_PROCESS, _RET_ALLOW, _RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """The classic-BPF seccomp program (``struct sock_filter[]`` bytes) for ``machine``; None if unsupported.

    A foreign architecture (e.g. 32-bit calls on x86-64) kills the process; ``clone3`` answers ``ENOSYS``
    (glibc then falls back to ``clone``), ``clone`` is allowed only with ``CLONE_THREAD``, every call in
    the table except those two is refused with ``EPERM``, everything else is allowed.
    """
    machine = machine or platform.machine()
    if machine not in _SYSCALLS:
        return None
    arch, nr = _SYSCALLS[machine]

    def ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    prog = [ins(_LD_W_ABS, 4), ins(_JEQ, arch, 1, 0), ins(_RET, _RET_KILL_PROCESS), ins(_LD_W_ABS, 0)]
    if machine == "x86_64":  # the x32 ABI reuses the arch value with this bit set in the number
        prog += [ins(_JGE, _X32_BIT, 0, 1), ins(_RET, _RET_ERRNO | _EPERM)]
    prog += [ins(_JEQ, nr["clone3"], 0, 1), ins(_RET, _RET_ERRNO | _ENOSYS)]
    # clone: load the low word of args[0] (flags; little-endian), allow threads only
    prog += [ins(_JEQ, nr["clone"], 0, 4), ins(_LD_W_ABS, 16), ins(_JSET, _CLONE_THREAD, 0, 1),
             ins(_RET, _RET_ALLOW), ins(_RET, _RET_ERRNO | _EPERM)]
    for name, number in nr.items():
        if name not in ("clone", "clone3"):
            prog += [ins(_JEQ, number, 0, 1), ins(_RET, _RET_ERRNO | _EPERM)]
    prog.append(ins(_RET, _RET_ALLOW))
    return b"".join(prog)


def seccomp_prelude() -> str:
    """Python source that installs :func:`seccomp_filter` in the running interpreter (exit 97 if that fails);
    "" where there is no filter for this machine. :func:`run_program` runs it before anything else."""
    filt = seccomp_filter()
    return "" if filt is None else _SECCOMP.replace("__SECCOMP_HEX__", repr(filt.hex()))


# Runs first in the child (part of the ``python -c`` source): installs the seccomp filter or exits with 97.
_SECCOMP = r'''
def _pardec_seccomp(program):
    import ctypes, sys
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(program, len(program))
    prog = Prog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    # PR_SET_NO_NEW_PRIVS = 38, PR_SET_SECCOMP = 22, SECCOMP_MODE_FILTER = 2
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:
        sys.stderr.write(f"sandbox: installing the seccomp filter failed (errno {ctypes.get_errno()})\n")
        sys.stderr.flush()
        import os
        os._exit(97)


_pardec_seccomp(bytes.fromhex(__SECCOMP_HEX__))
del _pardec_seccomp
'''
