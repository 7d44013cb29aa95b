"""Run model-written Python in a sandbox: `run_python` and the policy-facing `python_tool`.

Every call starts a fresh process tree (`sandbox_launcher.py`) that puts these
layers in force, each detected at runtime and reported in
`SandboxResult.isolation` (see docs/rollouts.md):

* limits: wall clock (the whole process group is SIGKILLed), CPU seconds
  (RLIMIT_CPU), address space (RLIMIT_AS), file size (RLIMIT_FSIZE), open
  files, processes + threads (RLIMIT_NPROC), stdout/stderr caps (read
  incrementally; the program is killed when a stream overflows);
* user: when the caller is root, an unprivileged uid leased exclusively from a
  pool (62000-62999; else `nobody`), so the program cannot read the caller's
  0600 files and RLIMIT_NPROC is enforced and not shared with other sandboxes;
* namespaces: network (no interfaces but a down loopback), IPC, mount (read-only
  file system, private tmpfs /tmp, /var/tmp, /dev/shm and working directory),
  PID (the kernel kills every leftover process when the sandbox's init exits,
  and /proc shows only the sandbox); a user namespace first when the caller is
  not root;
* without a network namespace, a seccomp filter refusing `socket()`;
* an empty environment apart from a few fixed variables;
* afterwards: the process group is killed, processes of the leased uid are
  swept, files it left in world-writable directories are removed, and the
  temporary directory is deleted, whatever happened.
"""

import contextlib
import dataclasses
import errno
import fcntl
import json
import math
import os
import pwd
import re
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection, Mapping

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")

UID_POOL_FIRST = 62000
UID_POOL_SIZE = 1000
NOBODY_UID = 65534
EXIT_SETUP_FAILED = 125

# Layers the caller may switch off (tests and debugging), and ones it may require.
OPTIONAL_LAYERS = frozenset({"userns", "netns", "ipcns", "mountns", "pidns", "seccomp"})
REQUIRABLE_LAYERS = frozenset({
    "user", "network", "netns", "ipcns", "mountns", "pidns", "seccomp", "no_new_privs",
    "readonly_root", "private_tmp", "fresh_proc", "user_namespace",
})

# After the launcher exits, how long pipes held open by escaped processes may stay open.
EXIT_GRACE_S = 0.2
SWEEP_DEADLINE_S = 2.0
STOP_GRACE_S = 3.0
WORLD_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")

_LAUNCHER_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
_PROGRAM_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONUNBUFFERED": "1",  # output written before a kill still reaches us
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
    # One thread per BLAS/OpenMP pool: thread stacks count against RLIMIT_AS
    # and threads against RLIMIT_NPROC.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}


class SandboxError(RuntimeError):
    """The sandbox could not run the program (not: the program failed)."""


class SandboxUnavailableError(SandboxError):
    """A layer named in `require=` could not be put in force here."""


@dataclasses.dataclass(frozen=True)
class Isolation:
    """What isolation was in force for one run (reported by the launcher before execve).

    Attributes:
      uid, gid: the host ids the program ran as.
      user: "pool" (an unprivileged uid leased to this run alone), "nobody"
        (shared unprivileged uid; the pool uid was refused) or "host" (the
        caller's own uid: the caller is not root; its files are readable).
      network: "netns" (fresh network namespace: no route anywhere, loopback
        down), "seccomp" (socket() refused) or "host" (no network isolation).
      pid_namespace: leftover processes die with the sandbox's init.
      mount_namespace: private mount table (required by the next three).
      readonly_root: every inherited mount is read-only for the program.
      private_tmp: /tmp, /var/tmp, /dev/shm are private tmpfs (gone afterwards).
      fresh_proc: /proc shows only the sandbox's processes.
      user_namespace: entered because the caller is not root.
      ipc_namespace: private System V IPC and POSIX message queues.
      no_new_privs: setuid binaries cannot raise privileges.
      seccomp: the socket() filter is installed.
      notes: why a layer is missing, one line each.
    """

    uid: int
    gid: int
    user: str
    network: str
    pid_namespace: bool
    mount_namespace: bool
    readonly_root: bool
    private_tmp: bool
    fresh_proc: bool
    user_namespace: bool
    ipc_namespace: bool
    no_new_privs: bool
    seccomp: bool
    notes: tuple[str, ...] = ()

    @classmethod
    def from_report(cls, report: Mapping) -> "Isolation":
        layers = report["layers"]
        network = "netns" if layers["netns"] else "seccomp" if layers["seccomp"] else "host"
        return cls(
            uid=report["uid"], gid=report["gid"], user=report["user"], network=network,
            pid_namespace=layers["pidns"], mount_namespace=layers["mountns"],
            readonly_root=layers["readonly_root"], private_tmp=layers["private_tmp"],
            fresh_proc=layers["fresh_proc"], user_namespace=layers["user_namespace"],
            ipc_namespace=layers["ipcns"], no_new_privs=layers["no_new_privs"],
            seccomp=layers["seccomp"], notes=tuple(report["notes"]))

    @property
    def dropped_privileges(self) -> bool:
        return self.user in ("pool", "nobody")

    def describe(self) -> str:
        """One line, e.g. 'uid 62000 (pool), network=netns, pidns, mountns (ro root, ...)'."""
        parts = [f"uid {self.uid} ({self.user})", f"network={self.network}"]
        if self.user_namespace:
            parts.append("userns")
        if self.pid_namespace:
            parts.append("pidns")
        if self.mount_namespace:
            extras = [name for name, on in [("ro root", self.readonly_root),
                                            ("private tmp", self.private_tmp),
                                            ("fresh /proc", self.fresh_proc)] if on]
            parts.append(f"mountns ({', '.join(extras)})" if extras else "mountns")
        if self.ipc_namespace:
            parts.append("ipcns")
        if self.no_new_privs:
            parts.append("no_new_privs")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What happened to one program.

    Attributes:
      stdout, stderr: decoded (UTF-8, invalid bytes replaced), each at most
        `max_output_bytes` bytes before decoding.
      exit_code: the program's exit status; negative: killed by that signal
        (-9 after a timeout or an output overflow, which the sandbox kills).
      timed_out: the wall-clock limit expired and the sandbox killed it.
      killed_by: which limit ended the program, None if it ended on its own
        terms (including an ordinary exception): "timeout", "output_limit",
        "cpu_limit", "memory_limit", "file_size_limit", "process_limit", or
        "signal:<NAME>". "memory_limit", "file_size_limit" and
        "process_limit" are read off the final traceback line (MemoryError,
        EFBIG, EAGAIN from fork/thread creation): the program can fake them,
        which affects only this report.
      truncated: a stream hit `max_output_bytes`.
      isolation: the layers in force (None only if the program never started,
        e.g. the timeout expired during setup).
      wall_s: seconds from launch to the end of cleanup-critical work.
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    killed_by: str | None = None
    truncated: bool = False
    isolation: Isolation | None = None
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_by is None


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    cpu_s: float | None = None,
    max_output_bytes: int = 65536,
    max_file_mb: int = 16,
    disk_mb: int = 64,
    max_processes: int = 32,
    max_open_files: int = 256,
    env: Mapping[str, str] | None = None,
    python: str | None = None,
    require: Collection[str] = (),
    without: Collection[str] = (),
) -> SandboxResult:
    """Run `code` as `main.py` in a fresh sandbox and return what happened.

    Args:
      code: the program text.
      timeout_s: wall-clock limit; then every process of the sandbox is killed.
      memory_mb: address-space limit per process (RLIMIT_AS, virtual memory).
      cpu_s: CPU-seconds limit per process (RLIMIT_CPU, whole seconds, rounded
        up); default: the timeout.
      max_output_bytes: cap on each of stdout and stderr.
      max_file_mb: largest file the program may write (RLIMIT_FSIZE).
      disk_mb: size of each private tmpfs (working directory, /tmp, ...).
      max_processes: processes + threads of the sandbox uid (RLIMIT_NPROC).
      max_open_files: RLIMIT_NOFILE.
      env: extra environment variables for the program (nothing is inherited).
      python: interpreter to run (default: this one, `sys.executable`).
      require: layers that must be in force or `SandboxUnavailableError` is
        raised before the program starts; from `REQUIRABLE_LAYERS` ("network"
        means netns or seccomp, "user" an unprivileged uid).
      without: layers not to attempt, from `OPTIONAL_LAYERS` (tests, debugging).

    Returns:
      A `SandboxResult`. Program failures (exceptions, limits, timeouts) are
      results, not exceptions.

    Raises:
      TypeError, ValueError: bad arguments.
      SandboxError: the sandbox itself could not start the program.
    """
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailableError(f"the sandbox needs Linux, not {sys.platform}")
    _validate(code, timeout_s, memory_mb, cpu_s, max_output_bytes, max_file_mb, disk_mb,
              max_processes, max_open_files, require, without, env)
    python = _visible_interpreter(os.path.abspath(python or sys.executable))
    limits = {
        "cpu_s": math.ceil(cpu_s if cpu_s is not None else timeout_s),
        "memory_bytes": memory_mb * 2**20,
        "file_bytes": max_file_mb * 2**20,
        "processes": max_processes,
        "open_files": max_open_files,
    }
    is_root = os.geteuid() == 0
    start = time.monotonic()
    lease = base = None
    try:
        lease = _UID_POOL.lease() if is_root else None
        base = tempfile.mkdtemp(prefix="agentrl-sandbox-")
        os.chmod(base, 0o711)  # the sandbox uid may traverse to its workdir, not list
        workdir = os.path.join(base, "work")
        os.mkdir(workdir, 0o700)
        if lease is not None:
            os.chown(workdir, lease.uid, lease.uid)
        config = {
            "code": code, "python": python, "python_args": ["-s", "-B"], "workdir": workdir,
            "uid": lease.uid if lease else None, "gid": lease.uid if lease else None,
            "fallback_uid": NOBODY_UID, "limits": limits, "disk_bytes": disk_mb * 2**20,
            "env": {**_PROGRAM_ENV, "HOME": workdir, **(env or {})},
            "expose": _paths_to_expose(python),
            "require": sorted(require), "without": sorted(without),
        }
        config_path = os.path.join(base, "config.json")
        fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(config, handle)
        outcome = _launch_and_collect(config_path, base, start + timeout_s, max_output_bytes,
                                      lease.uid if lease else None)
        result = _result(outcome, start)
    finally:
        leftovers = _cleanup(lease, base)
    if leftovers:
        # Reported rather than raised: the program's result is still valid.
        result = dataclasses.replace(
            result, stderr=result.stderr + f"\n[sandbox: {leftovers}]")
    return result


def python_tool(code: str, *, max_chars: int = 4000, stderr_chars: int = 2000,
                **options) -> str:
    """Run `code` and format the outcome as text for the policy.

    stdout (its tail if longer than `max_chars`), then the tail of stderr, then
    one status line when the program did not simply succeed, e.g.
    "[timed out after 5.0 s]", "[killed: memory limit]", "[output truncated]",
    "[exit code 1]". A silent success gives "[no output]". `options` go to
    `run_python`. Sandbox failures (SandboxError) are reported as text too, so
    a rollout never dies on a tool call.
    """
    try:
        result = run_python(code, **options)
    except SandboxError as error:
        return f"[sandbox error: {error}]"
    parts = []
    if result.stdout:
        parts.append(_tail(result.stdout, max_chars))
    if result.stderr.strip():
        parts.append(_tail(result.stderr, stderr_chars))
    status = _status_line(result, options.get("timeout_s", 5.0))
    if status:
        parts.append(status)
    return "\n".join(part.rstrip("\n") for part in parts) if parts else "[no output]"


def probe_isolation(**options) -> Isolation:
    """The isolation `run_python` gets here with these options (runs an empty program)."""
    result = run_python("pass", **options)
    if result.isolation is None:
        raise SandboxError(f"probe did not start: {result}")
    return result.isolation


# -- arguments ------------------------------------------------------------------------


def _validate(code, timeout_s, memory_mb, cpu_s, max_output_bytes, max_file_mb, disk_mb,
              max_processes, max_open_files, require, without, env) -> None:
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if "\x00" in code:
        raise ValueError("code must not contain NUL characters")
    if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive finite number, got {timeout_s!r}")
    if cpu_s is not None and not (math.isfinite(cpu_s) and cpu_s > 0):
        raise ValueError(f"cpu_s must be positive, got {cpu_s!r}")
    for name, value, minimum in [("memory_mb", memory_mb, 64),
                                 ("max_output_bytes", max_output_bytes, 1),
                                 ("max_file_mb", max_file_mb, 1), ("disk_mb", disk_mb, 1),
                                 ("max_processes", max_processes, 4),
                                 ("max_open_files", max_open_files, 16)]:
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    for key, value in (env or {}).items():
        if not (isinstance(key, str) and isinstance(value, str)) or not key or "=" in key \
                or "\x00" in key + value:
            raise ValueError(f"env must map names to str values (no '=' in names, no NUL), "
                             f"got {key!r}: {value!r}")
    for name, given, allowed in [("require", require, REQUIRABLE_LAYERS),
                                 ("without", without, OPTIONAL_LAYERS)]:
        if isinstance(given, str):
            raise TypeError(f"{name} must be a collection of layer names, not a str")
        unknown = set(given) - allowed
        if unknown:
            raise ValueError(f"unknown layer(s) in {name}: {sorted(unknown)}; "
                             f"choose from {sorted(allowed)}")


PRIVATE_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # the launcher mounts a tmpfs on each


def _visible_interpreter(python: str) -> str:
    """`python`, or the interpreter it links to when it lies under a private-tmp directory.

    A virtualenv created under /tmp (e.g. a CI checkout there) would vanish
    behind the sandbox's private tmpfs; its `bin/python` is a symlink to the
    base interpreter, which runs the program instead (with the standard library
    and the base installation's packages, not the virtualenv's).
    """
    def hidden(path: str) -> bool:
        return any(path == d or path.startswith(d + "/") for d in PRIVATE_TMP_DIRS)

    if not hidden(python):
        return python
    real = os.path.realpath(python)
    if hidden(real):
        raise SandboxError(
            f"the interpreter {python} lies under {'/'.join(PRIVATE_TMP_DIRS)}, which the "
            "sandbox replaces by a private tmpfs; pass python= an interpreter outside them.")
    return real


def _paths_to_expose(python: str) -> list[str]:
    """Directories the program's interpreter needs (re-exposed if hidden from the uid)."""
    candidates = {os.path.dirname(os.path.realpath(python))}
    if python == os.path.abspath(sys.executable):
        candidates |= {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    else:
        candidates.add(os.path.dirname(os.path.dirname(os.path.realpath(python))))
    paths = sorted(os.path.realpath(path) for path in candidates if os.path.isdir(path))
    # A path inside another one is exposed with it.
    return [path for path in paths
            if not any(path != other and path.startswith(other.rstrip("/") + "/")
                       for other in paths)]


# -- the uid pool -----------------------------------------------------------------------


@dataclasses.dataclass
class _Lease:
    uid: int
    lock_fd: int


class _UidPool:
    """Unprivileged uids leased to one sandbox at a time, across threads and processes.

    A uid is free when no thread of this process holds it, no other process
    holds its flock, no account uses it and no process runs under it.
    """

    def __init__(self, first: int, size: int):
        self.first, self.size = first, size
        self._lock = threading.Lock()
        self._leased: set[int] = set()
        self._next = 0

    def _lock_dir(self) -> str:
        # /run is writable only by root; a world-writable /tmp is the fallback,
        # where a squatted directory is refused rather than trusted.
        parent = "/run" if os.path.isdir("/run") and os.access("/run", os.W_OK) \
            else tempfile.gettempdir()
        path = os.path.join(parent, "agentrl-sandbox-uids")
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o077:
            raise SandboxError(f"{path} must be a directory owned by root with mode 0700")
        return path

    def lease(self) -> _Lease:
        lock_dir = self._lock_dir()
        with self._lock:
            for step in range(self.size):
                uid = self.first + (self._next + step) % self.size
                if uid in self._leased or _has_account(uid):
                    continue
                fd = os.open(os.path.join(lock_dir, f"{uid}.lock"),
                             os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                if _live_pids_of_uid(uid):  # left over from a crashed caller
                    os.close(fd)
                    continue
                self._leased.add(uid)
                self._next = (uid - self.first + 1) % self.size
                return _Lease(uid, fd)
        raise SandboxError(f"all {self.size} sandbox uids are in use")

    def release(self, lease: _Lease) -> None:
        os.close(lease.lock_fd)
        with self._lock:
            self._leased.discard(lease.uid)


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


_UID_POOL = _UidPool(UID_POOL_FIRST, UID_POOL_SIZE)


# -- launching and collecting -----------------------------------------------------------


@dataclasses.dataclass
class _Outcome:
    stdout: bytes
    stderr: bytes
    returncode: int
    timed_out: bool
    truncated: bool
    reports: list[dict]


def _launch_and_collect(config_path: str, base: str, deadline: float,
                        max_output_bytes: int, sweep_uid: int | None) -> _Outcome:
    report_read, report_write = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", LAUNCHER, config_path, str(report_write)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(report_write,), env=_LAUNCHER_ENV, cwd=base, start_new_session=True)
    except BaseException:
        os.close(report_read)
        raise
    finally:
        os.close(report_write)
    stdout_fd, stderr_fd = process.stdout.fileno(), process.stderr.fileno()
    buffers = {stdout_fd: bytearray(), stderr_fd: bytearray(), report_read: bytearray()}
    selector = selectors.DefaultSelector()
    try:
        for fd in buffers:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        timed_out, truncated = _pump(process, selector, buffers, report_read, deadline,
                                     max_output_bytes)
    finally:
        # Also on an exception here (e.g. KeyboardInterrupt): nothing may outlive us.
        _stop(process, sweep_uid)
    try:
        for fd in list(selector.get_map()):  # what was written before the kill
            truncated |= _read_into(fd, buffers, report_read, max_output_bytes, selector)
    finally:
        selector.close()
        os.close(report_read)
        process.stdout.close()
        process.stderr.close()
    reports = []
    for line in bytes(buffers[report_read]).splitlines():
        with contextlib.suppress(ValueError):  # a line cut short by a kill during setup
            reports.append(json.loads(line))
    return _Outcome(bytes(buffers[stdout_fd]), bytes(buffers[stderr_fd]),
                    process.returncode, timed_out, truncated, reports)


def _pump(process, selector, buffers, report_fd, deadline, max_output_bytes):
    """Read the pipes until EOF, the deadline or an overflow: (timed_out, truncated)."""
    exited_at = None
    while selector.get_map():
        now = time.monotonic()
        if now >= deadline:
            return True, False
        if exited_at is None and _has_exited(process.pid):
            exited_at = now
        if exited_at is not None and now - exited_at > EXIT_GRACE_S:
            break  # escaped processes hold the pipes; _stop kills them
        for key, _ in selector.select(timeout=min(deadline - now, 0.05)):
            if _read_into(key.fd, buffers, report_fd, max_output_bytes, selector):
                return False, True
    return False, False


def _stop(process: subprocess.Popen, sweep_uid: int | None) -> None:
    """Kill everything the launch started, then reap the launcher."""
    if sweep_uid is not None:
        # Root caller: the leased uid's processes, wherever they are.
        _kill_uid(sweep_uid)
    if not _has_exited(process.pid):
        # The launcher kills its child on SIGTERM and exits once the whole tree
        # is reaped (or the PID namespace is gone), so nothing is left running
        # and no zombie is handed to the host's init.
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while not _has_exited(process.pid) and time.monotonic() < deadline:
            time.sleep(0.002)
    # Last resort, and for processes the launcher could not reach: its session
    # (every process it started that did not call setsid). Before reaping: while
    # the launcher is an unreaped zombie its pid, the session id, is not reused.
    _kill_session(process.pid)
    process.wait()


def _read_into(fd: int, buffers: dict, report_fd: int, cap: int, selector) -> bool:
    """Read what is available from fd; returns True if an output stream overflowed."""
    overflow = False
    while True:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return overflow
        if not data:
            selector.unregister(fd)
            return overflow
        buffer = buffers[fd]
        if fd == report_fd:
            buffer += data
            continue
        room = cap - len(buffer)
        buffer += data[:max(room, 0)]
        if len(data) > room:
            return True


def _has_exited(pid: int) -> bool:
    """Whether the child exited, without reaping it (WNOWAIT)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _kill_session(session: int) -> None:
    """SIGKILL the launcher's session until no live member is left (forks race the kill)."""
    deadline = time.monotonic() + SWEEP_DEADLINE_S
    while time.monotonic() < deadline:
        members = _live_members_of_session(session)
        if not members:
            return
        for pid in members:
            _kill_verified(pid, lambda pid=pid: bool(_live_members_of_session(session, pid)))
        time.sleep(0.002)


def _live_members_of_session(session: int, only: int | None = None) -> list[int]:
    members = []
    for name in [str(only)] if only is not None else os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{name}/stat", encoding="utf-8") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == session and fields[0] != "Z":
                    members.append(int(name))
    return members


# -- the result -------------------------------------------------------------------------

_LAST_LINE_LIMITS = [
    (re.compile(r"^([\w.]*MemoryError\b|.*Cannot allocate memory)"), "memory_limit"),
    (re.compile(r".*\[Errno 27\] File too large"), "file_size_limit"),
    (re.compile(r"^(BlockingIOError: \[Errno 11\]|RuntimeError: can't start new thread)"),
     "process_limit"),
]


def _result(outcome: _Outcome, start: float) -> SandboxResult:
    reports = outcome.reports
    errors = [report[key] for report in reports for key in ("error", "exec_error")
              if key in report]
    if errors:
        raise SandboxError("; ".join(errors))
    report = next((r for r in reports if "layers" in r), None)
    stdout = outcome.stdout.decode("utf-8", errors="replace")
    stderr = outcome.stderr.decode("utf-8", errors="replace")
    if report is None and not outcome.timed_out:
        raise SandboxError(f"the sandbox launcher failed (exit {outcome.returncode}): "
                           f"{stderr[-2000:]}")
    isolation = Isolation.from_report(report) if report else None
    if report and report["missing"]:
        raise SandboxUnavailableError(
            f"required isolation not available here: {report['missing']}; "
            f"got {isolation.describe()}; notes: {'; '.join(report['notes'])}")
    return SandboxResult(
        stdout=stdout, stderr=stderr, exit_code=outcome.returncode,
        timed_out=outcome.timed_out,
        killed_by=_killed_by(outcome, stderr), truncated=outcome.truncated,
        isolation=isolation, wall_s=time.monotonic() - start)


def _killed_by(outcome: _Outcome, stderr: str) -> str | None:
    code = outcome.returncode
    if outcome.timed_out:
        return "timeout"
    if outcome.truncated:
        return "output_limit"
    if code == -signal.SIGXCPU:
        return "cpu_limit"
    if code == -signal.SIGXFSZ:
        return "file_size_limit"
    if code < 0:
        try:
            return f"signal:{signal.Signals(-code).name}"
        except ValueError:
            return f"signal:{-code}"
    if code != 0:
        lines = [line for line in stderr.splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        for pattern, limit in _LAST_LINE_LIMITS:
            if pattern.match(last):
                return limit
    return None


def _status_line(result: SandboxResult, timeout_s: float) -> str | None:
    killed_by = result.killed_by
    if killed_by == "timeout":
        return f"[timed out after {timeout_s} s]"
    if killed_by == "output_limit":
        return "[output truncated: the program was stopped]"
    if killed_by is not None:
        return f"[killed: {killed_by.replace('_', ' ').replace(':', ' ')}]"
    if result.truncated:
        return "[output truncated]"
    if result.exit_code != 0:
        return f"[exit code {result.exit_code}]"
    return None


def _tail(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"[... {len(text) - limit} characters cut ...]\n" + text[-limit:]


# -- cleanup ----------------------------------------------------------------------------


def _cleanup(lease: _Lease | None, base: str | None) -> str:
    """Kill the lease's processes, remove its files and the base dir; '' or a problem."""
    problems = []
    if lease is not None:
        survivors = _kill_uid(lease.uid)
        if survivors:
            problems.append(f"processes of uid {lease.uid} survived: {survivors}")
        else:
            _remove_files_of(lease.uid)
    if base is not None:
        shutil.rmtree(base, ignore_errors=True)
    if base is not None and os.path.exists(base):
        problems.append(f"could not remove {base}")
    if lease is not None:
        if problems:
            os.close(lease.lock_fd)  # quarantined: never leased again by this process
        else:
            _UID_POOL.release(lease)
    return "; ".join(problems)


def _uids_of(pid: str) -> tuple[set[int], str] | None:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as handle:
            text = handle.read()
    except OSError:
        return None
    uids = state = None
    for line in text.splitlines():
        if line.startswith("Uid:"):
            uids = {int(value) for value in line.split()[1:]}
        elif line.startswith("State:"):
            state = line.split()[1]
    return (uids, state) if uids is not None else None


def pids_of_uid(uid: int, *, include_zombies: bool = True) -> list[int]:
    """Processes (host pids) whose real, effective, saved or fs uid is `uid`."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            found = _uids_of(name)
            if found and uid in found[0] and (include_zombies or found[1] != "Z"):
                pids.append(int(name))
    return pids


def _live_pids_of_uid(uid: int) -> list[int]:
    return pids_of_uid(uid, include_zombies=False)


def _kill_uid(uid: int) -> list[int]:
    """SIGKILL every process of uid until none is left; returns survivors after the deadline."""
    deadline = time.monotonic() + SWEEP_DEADLINE_S
    while True:
        pids = _live_pids_of_uid(uid)
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            _kill_verified(pid, lambda pid=pid: uid in (_uids_of(str(pid)) or ({-1}, ""))[0])
        time.sleep(0.005)


def _kill_verified(pid: int, still_ours) -> None:
    """SIGKILL through a pidfd after re-checking `still_ours()`, so a reused pid is never hit."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError as error:
        if error.errno != errno.ENOSYS:
            return
        # Kernels before 5.3: a (tiny) pid-reuse window between the check and the kill.
        if still_ours():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return
    try:
        if still_ours():
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)


def _remove_files_of(uid: int) -> None:
    """Remove what uid left in the world-writable directories (no private /tmp case)."""
    roots = {os.path.realpath(tempfile.gettempdir()), *WORLD_WRITABLE_DIRS}
    for root in sorted(roots):
        _remove_entries_of(uid, root, depth=3)


def _remove_entries_of(uid: int, directory: str, depth: int) -> None:
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if info.st_uid == uid:
            if stat.S_ISDIR(info.st_mode):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
        elif depth > 1 and stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_IWOTH:
            _remove_entries_of(uid, entry.path, depth - 1)
