"""The sandbox's launcher: runs between `run_python` and the model-written program.

`agentrl.envs.sandbox.run_python` starts this file as a script
(`python -I -S -B sandbox_launcher.py CONFIG REPORT_FD`), in a new session and
with an empty environment. It only imports the standard library (it must not
import `agentrl`, whose import pulls in JAX). It puts the isolation layers in
force, best effort, in this order:

1. namespaces (`unshare` through ctypes; Python 3.11 has no `os.unshare`): a
   user namespace when the caller is not root, then network, IPC, mount and
   PID namespaces, each on its own so that one refusal costs only that layer;
2. with a PID namespace, a fork: the child is PID 1 of the new namespace, a
   minimal init that mounts, starts the program and waits for it. When it
   exits the kernel kills every process left in the namespace;
3. with a mount namespace (made private first, so nothing propagates to the
   host): every inherited mount remounted read-only (bind remounts: the host's
   mounts are not touched), private size-limited tmpfs on /tmp, /var/tmp,
   /dev/shm and on the working directory, a fresh /proc for the new PID
   namespace, and the Python installation re-exposed read-only where it lives
   under a directory the sandbox user may not enter (e.g. pyenv in /root,
   whose other contents stay hidden behind an empty tmpfs);
4. in the process that becomes the program: nice +10, supplementary groups
   cleared, the unprivileged uid/gid (when the caller is root),
   `no_new_privs`, a seccomp filter that refuses `socket()` when there is no
   network namespace, resource limits, then `execve` of the interpreter with a
   scrubbed environment.

Without a PID namespace this process stays as the program's parent and a child
subreaper. Either way it exits like the program (same code, same fatal
signal), and on SIGTERM (the caller's stop request) it SIGKILLs its child and
exits only once everything below it is gone.

One JSON line on REPORT_FD (close-on-exec, so it closes at the `execve`) says
which layers are in force, or why the launch failed. A second line appears
only if the `execve` itself failed.
"""

import contextlib
import ctypes
import errno
import json
import os
import platform
import resource
import signal
import stat
import struct
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
MOUNT_OPTION_FLAGS = {
    "ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}

PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2

# Classic BPF over `struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6];}`.
BPF_LD_W_ABS = 0x20
BPF_JEQ_K = 0x15
BPF_JGE_K = 0x35
BPF_RET_K = 0x06
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
X32_SYSCALL_BIT = 0x40000000
# machine -> (AUDIT_ARCH_*, __NR_socket, __NR_io_uring_setup, has the x32 ABI)
SECCOMP_ARCHES = {
    "x86_64": (0xC000003E, 41, 425, True),
    "aarch64": (0xC00000B7, 198, 425, False),
}

EXIT_SETUP_FAILED = 125
PROGRAM_NICE_INCREMENT = 10

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                       ctypes.c_char_p]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                       ctypes.c_ulong]


class SetupError(Exception):
    """A required step failed; the program is not started."""


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _unshare(flags: int, what: str) -> None:
    _check(libc.unshare(flags), f"unshare({what})")


def _mount(source, target, fstype, flags, data=None) -> None:
    def enc(value):
        return None if value is None else os.fsencode(value)

    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
           f"mount {fstype or source or ''} on {target}")


def _prctl(option: int, arg2: int) -> None:
    _check(libc.prctl(option, arg2, 0, 0, 0), f"prctl({option})")


def _errno_name(error: OSError) -> str:
    return f"{errno.errorcode.get(error.errno, error.errno)}"


class Launch:
    """The state of one launch: the config, what is in force, what was refused."""

    def __init__(self, config: dict, report_fd: int):
        self.config = config
        self.report_fd = report_fd
        self.caller_is_root = os.geteuid() == 0
        self.layers = {
            "user_namespace": False, "netns": False, "ipcns": False, "mountns": False,
            "pidns": False, "readonly_root": False, "private_tmp": False,
            "fresh_proc": False, "seccomp": False, "no_new_privs": False,
        }
        self.notes: list[str] = []
        self.uid = os.getuid()
        self.gid = os.getgid()
        self.user = "host"

    def wants(self, layer: str) -> bool:
        return layer not in self.config["without"]

    def note(self, text: str) -> None:
        self.notes.append(text)

    def report(self, **fields) -> None:
        payload = json.dumps(fields).encode() + b"\n"
        with contextlib.suppress(OSError):
            os.write(self.report_fd, payload)

    # -- namespaces ----------------------------------------------------------------

    def enter_namespaces(self) -> None:
        if not self.caller_is_root and self.wants("userns"):
            self._enter_user_namespace()
        for layer, flag, name in [("netns", CLONE_NEWNET, "CLONE_NEWNET"),
                                  ("ipcns", CLONE_NEWIPC, "CLONE_NEWIPC"),
                                  ("mountns", CLONE_NEWNS, "CLONE_NEWNS"),
                                  ("pidns", CLONE_NEWPID, "CLONE_NEWPID")]:
            if not self.wants(layer):
                self.note(f"{layer}: disabled by the caller")
                continue
            try:
                _unshare(flag, name)
                self.layers[layer] = True
            except OSError as error:
                self.note(f"{layer}: unshare({name}) refused ({_errno_name(error)})")

    def _enter_user_namespace(self) -> None:
        # Map the caller's ids onto themselves: the program keeps its uid, and
        # loses the namespace's capabilities at execve because it is not uid 0.
        uid, gid = os.geteuid(), os.getegid()
        try:
            _unshare(CLONE_NEWUSER, "CLONE_NEWUSER")
            with open("/proc/self/setgroups", "w") as handle:
                handle.write("deny")
            with open("/proc/self/uid_map", "w") as handle:
                handle.write(f"{uid} {uid} 1")
            with open("/proc/self/gid_map", "w") as handle:
                handle.write(f"{gid} {gid} 1")
            self.layers["user_namespace"] = True
        except OSError as error:
            self.note(f"userns: unshare(CLONE_NEWUSER) refused ({_errno_name(error)})")

    # -- mounts --------------------------------------------------------------------

    def setup_mounts(self) -> None:
        """Private, read-only view of the file system; False layers stay reported."""
        try:
            _mount(None, "/", None, MS_REC | MS_PRIVATE)
        except OSError as error:
            # Without a private tree a mount could propagate to the host: no mounts.
            self.layers["mountns"] = False
            self.note(f"mountns: cannot make / private ({_errno_name(error)})")
            return
        exposed = self._open_exposed_paths()
        self._remount_readonly()
        self._mount_private_tmp()
        self._reexpose(exposed)
        if self.layers["pidns"]:
            try:
                _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                self.layers["fresh_proc"] = True
            except OSError as error:
                self.note(f"fresh_proc: mount proc refused ({_errno_name(error)})")
        self._mount_workdir()

    def _open_exposed_paths(self) -> list[tuple[str, str, int]]:
        """(hidden ancestor, path, O_PATH fd) for each needed path the user cannot reach."""
        exposed = []
        for path in self.config["expose"]:
            hidden = self._first_hidden_ancestor(path)
            if hidden is not None:
                fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                exposed.append((hidden, path, fd))
        return exposed

    def _first_hidden_ancestor(self, path: str) -> str | None:
        if not self.caller_is_root or self.config["uid"] is None:
            return None
        parts = path.strip("/").split("/")
        for depth in range(len(parts) + 1):
            directory = "/" + "/".join(parts[:depth])
            try:
                info = os.stat(directory)
            except OSError:
                return None
            if stat.S_ISDIR(info.st_mode) and not info.st_mode & stat.S_IXOTH:
                return directory
        return None

    def _remount_readonly(self) -> None:
        mounts = []
        with open("/proc/self/mountinfo") as handle:
            for line in handle:
                fields = line.split()
                target = fields[4].encode().decode("unicode_escape")
                flags = 0
                for option in fields[5].split(","):
                    flags |= MOUNT_OPTION_FLAGS.get(option, 0)
                mounts.append((target, flags))
        failed = []
        for target, flags in mounts:
            try:
                _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
            except OSError as error:
                failed.append(f"{target} ({_errno_name(error)})")
        if not any(target == "/" for target, _ in mounts) or any(
                entry.startswith("/ (") for entry in failed):
            self.note("readonly_root: / could not be remounted read-only")
        else:
            self.layers["readonly_root"] = True
        if failed:
            self.note("readonly_root: not remounted read-only: " + ", ".join(failed[:8]))

    def _mount_private_tmp(self) -> None:
        size = self.config["disk_bytes"]
        mounted = []
        for target in ["/tmp", "/var/tmp", "/dev/shm"]:
            if not os.path.isdir(target) or os.path.islink(target):
                continue
            try:
                _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV,
                       f"size={size},mode=1777")
                mounted.append(target)
            except OSError as error:
                self.note(f"private_tmp: tmpfs on {target} refused ({_errno_name(error)})")
        self.layers["private_tmp"] = "/tmp" in mounted

    def _reexpose(self, exposed: list[tuple[str, str, int]]) -> None:
        for hidden in sorted({entry[0] for entry in exposed}):
            _mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
        for _, path, fd in exposed:
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
            _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
            os.close(fd)

    def _mount_workdir(self) -> None:
        workdir = self.config["workdir"]
        os.makedirs(workdir, mode=0o711, exist_ok=True)
        owner = f",uid={self.config['uid']},gid={self.config['gid']}" \
            if self.config["uid"] is not None else ""
        _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
               f"size={self.config['disk_bytes']},mode=0700{owner}")

    # -- the program ---------------------------------------------------------------

    def write_program(self) -> None:
        path = os.path.join(self.config["workdir"], "main.py")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(self.config["code"])
        if self.config["uid"] is not None:
            os.chown(path, self.config["uid"], self.config["gid"])

    def set_limits(self) -> None:
        limits = self.config["limits"]
        cpu = limits["cpu_s"]
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # RLIMIT_NPROC counts every task (thread) of the real uid within the
        # user namespace and is not enforced for root: exact for a leased uid or
        # a fresh user namespace; otherwise the caller's tasks count too.
        processes = limits["processes"]
        if self.config["uid"] is None and not self.layers["user_namespace"]:
            existing = _tasks_of_uid(os.getuid())
            processes += existing
            self.note(f"processes: RLIMIT_NPROC {processes} = {limits['processes']} + the "
                      f"{existing} tasks the caller's uid already has (shared uid)")
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))

    def drop_privileges(self) -> None:
        if not self.caller_is_root:
            return
        if self.config["uid"] is None:
            self.note("user: privilege drop disabled by the caller; runs as root")
            self.uid, self.gid, self.user = 0, 0, "host"
            return
        candidates = [(self.config["uid"], self.config["gid"], "pool"),
                      (self.config["fallback_uid"], self.config["fallback_uid"], "nobody")]
        for uid, gid, kind in candidates:
            try:
                # The working directory and program were made for the pool uid.
                os.chown(".", uid, gid)
                os.chown("main.py", uid, gid)
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
            except OSError as error:
                self.note(f"user: cannot switch to uid {uid} ({_errno_name(error)})")
                continue
            if os.getresuid() != (uid,) * 3 or os.getresgid() != (gid,) * 3 or uid == 0:
                raise SetupError(f"privilege drop to uid {uid} did not take effect")
            self.uid, self.gid, self.user = uid, gid, kind
            return
        raise SetupError("cannot drop root privileges to an unprivileged uid")

    def restrict_syscalls(self) -> None:
        try:
            _prctl(PR_SET_NO_NEW_PRIVS, 1)
            self.layers["no_new_privs"] = True
        except OSError as error:
            self.note(f"no_new_privs: refused ({_errno_name(error)})")
        if self.layers["netns"] or not self.wants("seccomp"):
            return
        arch = SECCOMP_ARCHES.get(platform.machine())
        if arch is None:
            self.note(f"seccomp: no filter for {platform.machine()}")
            return
        if not self.layers["no_new_privs"]:
            self.note("seccomp: needs no_new_privs")
            return
        try:
            _install_socket_filter(*arch)
            self.layers["seccomp"] = True
        except OSError as error:
            self.note(f"seccomp: filter refused ({_errno_name(error)})")

    def environment(self) -> dict:
        env = dict(self.config["env"])
        env["TMPDIR"] = "/tmp" if self.layers["private_tmp"] else self.config["workdir"]
        return env

    def exec_program(self) -> None:
        """Become the program (never returns)."""
        try:
            os.chdir(self.config["workdir"])
            # Under contention the host, and the launcher that must kill a runaway
            # program, get the CPU first.
            os.nice(PROGRAM_NICE_INCREMENT)
            self.drop_privileges()
            self.restrict_syscalls()
            # Last: a low RLIMIT_AS must not starve the launcher's own work.
            self.set_limits()
            os.umask(0o077)
        except (OSError, SetupError) as error:
            self.report(error=f"sandbox setup failed: {error}")
            os._exit(EXIT_SETUP_FAILED)
        missing = [layer for layer in self.config["require"] if not self._has(layer)]
        self.report(uid=self.uid, gid=self.gid, user=self.user, layers=self.layers,
                    notes=self.notes, missing=missing)
        if missing:
            os._exit(EXIT_SETUP_FAILED)
        python = self.config["python"]
        try:
            os.execve(python, [python, *self.config["python_args"], "main.py"],
                      self.environment())
        except OSError as error:
            message = f"cannot execute {python}: {error}"
            hidden = sorted({self._first_hidden_ancestor(path) for path in self.config["expose"]}
                            - {None})
            if hidden and not self.layers["mountns"]:
                message += (f" (the interpreter lives under {', '.join(hidden)}, which uid "
                            f"{self.uid} may not enter, and without a mount namespace it "
                            "cannot be re-exposed: pass python= an interpreter every user "
                            "can read)")
            self.report(exec_error=message)
            os._exit(EXIT_SETUP_FAILED)

    def _has(self, layer: str) -> bool:
        if layer == "user":
            return self.user in ("pool", "nobody")
        if layer == "network":
            return self.layers["netns"] or self.layers["seccomp"]
        return bool(self.layers.get(layer))


def _tasks_of_uid(uid: int) -> int:
    tasks = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as handle:
                fields = dict(line.split(":", 1) for line in handle if ":" in line)
        except OSError:
            continue
        if int(fields["Uid"].split()[0]) == uid:
            tasks += int(fields["Threads"])
    return tasks


def _install_socket_filter(audit_arch: int, nr_socket: int, nr_io_uring: int,
                           has_x32: bool) -> None:
    """Refuse socket() (EACCES) and io_uring (ENOSYS); kill on a foreign syscall ABI.

    socketpair() stays allowed (asyncio needs it) and cannot reach anything.
    io_uring is refused because it can create sockets without socket().
    """
    def stmt(code, k):
        return (code, 0, 0, k)

    def jump(code, k, if_true, if_false):
        return (code, if_true, if_false, k)

    program = [
        stmt(BPF_LD_W_ABS, 4),                                      # arch
        jump(BPF_JEQ_K, audit_arch, 1, 0),
        stmt(BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
        stmt(BPF_LD_W_ABS, 0),                                      # nr
    ]
    if has_x32:
        program += [jump(BPF_JGE_K, X32_SYSCALL_BIT, 0, 1),
                    stmt(BPF_RET_K, SECCOMP_RET_KILL_PROCESS)]
    program += [
        jump(BPF_JEQ_K, nr_socket, 0, 1),
        stmt(BPF_RET_K, SECCOMP_RET_ERRNO | errno.EACCES),
        jump(BPF_JEQ_K, nr_io_uring, 0, 1),
        stmt(BPF_RET_K, SECCOMP_RET_ERRNO | errno.ENOSYS),
        stmt(BPF_RET_K, SECCOMP_RET_ALLOW),
    ]
    filters = b"".join(struct.pack("HBBI", *instruction) for instruction in program)
    buffer = ctypes.create_string_buffer(filters)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(program), ctypes.addressof(buffer))
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0),
           "prctl(PR_SET_SECCOMP)")


def _setup_files(launch: Launch) -> None:
    try:
        if launch.layers["mountns"]:
            launch.setup_mounts()
        launch.write_program()
    except OSError as error:
        launch.report(error=f"sandbox setup failed: {error}")
        os._exit(EXIT_SETUP_FAILED)


def _wait_for(program: int) -> int:
    """Reap children until `program` exits; returns its wait status."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(EXIT_SETUP_FAILED)
        if pid == program:
            return status


def _wait_until_exited(child: int) -> None:
    """Reap other children until `child` has exited, leaving `child` unreaped (a zombie),
    so that its pid, and the process group named after it, cannot be reused meanwhile."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            os._exit(EXIT_SETUP_FAILED)
        if info.si_pid == child:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, 0)


def _reap(child: int) -> int:
    """Reap an exited `child`; from now on SIGTERM must not name its (reusable) pid."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return os.waitpid(child, 0)[1]


def _live_members(group: int) -> list[int]:
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            members.append(int(name))
    return members


def _kill_group(group: int) -> None:
    """SIGKILL the program's process group until no live member is left.

    One killpg reaches every member at once (a member with a fatal signal
    pending cannot complete a fork), so a fork bomb ends in one or two rounds.
    """
    while True:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
        if not _live_members(group):
            return


def _children() -> list[int]:
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as handle:
            return [int(pid) for pid in handle.read().split()]
    except OSError:  # kernels without CONFIG_PROC_CHILDREN
        children = []
        for name in os.listdir("/proc"):
            try:
                with open(f"/proc/{name}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == os.getpid():
                children.append(int(name))
        return children


def _kill_descendants() -> None:
    """SIGKILL and reap children until none is left (orphans keep arriving as parents die).

    A child's pid cannot be reused before it is reaped, so signalling by pid is safe.
    """
    while True:
        for child in _children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _init(launch: Launch, status_fd: int) -> None:
    """PID 1 of the new PID namespace: mount, start the program, wait, report its status."""
    _setup_files(launch)
    program = os.fork()
    if program == 0:
        os.close(status_fd)
        launch.exec_program()
    os.close(launch.report_fd)
    status = _wait_for(program)
    os.write(status_fd, str(status).encode())
    # Exiting tears the namespace down: the kernel kills whatever is left in it.
    os._exit(0)


def _stop_on_sigterm(child: int) -> None:
    """On SIGTERM (the caller's stop request), SIGKILL `child` and carry on as if it died.

    The caller then sees this process exit only after the sandbox's processes
    are gone: reaped by this subreaper, or killed with the PID namespace.
    """
    def stop(signum, frame):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)

    signal.signal(signal.SIGTERM, stop)


def _exit_like(status: int) -> None:
    """Exit the way the program did: same exit code, or the same fatal signal."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        _prctl(PR_SET_DUMPABLE, 0)  # a re-raised SIGSEGV/SIGXCPU must not dump core
        if number not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(number, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [number])
        os.kill(os.getpid(), number)
        os._exit(128 + number)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else EXIT_SETUP_FAILED)


def main(argv: list[str]) -> None:
    config_path, report_fd = argv[1], int(argv[2])
    os.set_inheritable(report_fd, False)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    launch = Launch(config, report_fd)
    launch.enter_namespaces()
    if launch.layers["pidns"]:
        status_read, status_write = os.pipe()
        init = os.fork()
        if init == 0:
            os.close(status_read)
            _init(launch, status_write)
        _stop_on_sigterm(init)
        os.close(status_write)
        os.close(report_fd)
        # Returns only once init is gone, and init is gone only once the kernel
        # has killed every process of its namespace.
        _wait_until_exited(init)
        init_status = _reap(init)
        program_status = os.read(status_read, 64)
        _exit_like(int(program_status) if program_status else init_status)
    # No PID namespace: this process stays as the program's parent and a child
    # subreaper, so that orphans (double forks, setsid) are reparented here and
    # killed when the program ends instead of escaping to the host's init. The
    # program leads its own process group, killed as a whole when it ends.
    _setup_files(launch)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    program = os.fork()
    if program == 0:
        os.setpgid(0, 0)
        launch.exec_program()
    with contextlib.suppress(OSError):  # both sides set it: no race with the exec
        os.setpgid(program, program)
    _stop_on_sigterm(program)
    os.close(report_fd)
    _wait_until_exited(program)
    _kill_group(program)
    status = _reap(program)
    _kill_descendants()
    _exit_like(status)


if __name__ == "__main__":
    main(sys.argv)
