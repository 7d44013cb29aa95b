"""The code sandbox, attacked for real: each test asserts what the sandbox guarantees.

Guarantees depend on the isolation in force (root or not, namespaces allowed or
not); every test reads `SandboxResult.isolation` and asserts the guarantee of
the layer that is in force, including the documented fallbacks, which are also
forced explicitly with `without=` (and, without a mount namespace, a Python
that every user may read). Nothing is skipped.
"""

import concurrent.futures
import contextlib
import errno
import json
import os
import pathlib
import socket
import stat
import sys
import tempfile
import threading
import time
import uuid

import pytest

from agentrl.envs import sandbox
from agentrl.envs.sandbox import (
    SandboxError,
    SandboxUnavailableError,
    pids_of_uid,
    probe_isolation,
    python_tool,
    run_python,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAMESPACES = frozenset({"userns", "netns", "ipcns", "mountns", "pidns"})
SLACK_S = 2.0  # launch (two interpreter starts), kill and cleanup, on a loaded machine


def _reachable_by_others(path: str) -> bool:
    real = os.path.realpath(path)
    parts = real.strip("/").split("/")
    for depth in range(len(parts)):
        if not os.stat("/" + "/".join(parts[:depth])).st_mode & stat.S_IXOTH:
            return False
    return bool(os.stat(real).st_mode & stat.S_IXOTH)


@pytest.fixture(scope="module")
def world_python():
    """An interpreter usable without a mount namespace, or None (then runs must refuse)."""
    if os.geteuid() != 0:
        return sys.executable
    for candidate in [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]:
        if os.path.exists(candidate) and _reachable_by_others(candidate):
            try:
                if run_python("import sys", python=candidate, without=NAMESPACES).ok:
                    return candidate
            except SandboxError:
                continue
    return None


def run_bare(code, world_python, **options):
    """Run with no namespaces (the fallback); without a usable interpreter, assert refusal."""
    options.setdefault("without", NAMESPACES | {"seccomp"})
    if world_python is None:
        with pytest.raises(SandboxError, match="interpreter every user can read"):
            run_python(code, **options)
        return None
    return run_python(code, python=world_python, **options)


def workdir_of(result):
    return result.stdout.splitlines()[0]


def leftover_processes(result, workdir=None, marker=None):
    """Processes of the sandbox: its leased uid, its working directory, or a marker."""
    found = set()
    if result.isolation and result.isolation.user == "pool":
        found |= set(pids_of_uid(result.isolation.uid))
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if workdir and os.readlink(f"/proc/{name}/cwd") == workdir:
                found.add(int(name))
        with contextlib.suppress(OSError):
            if marker and marker.encode() in pathlib.Path(f"/proc/{name}/cmdline").read_bytes():
                found.add(int(name))
    return sorted(found)


def zombie_children():
    zombies = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                fields = pathlib.Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
                if fields[0] == "Z" and int(fields[1]) == os.getpid():
                    zombies.append(int(name))
    return zombies


def rss_mb():
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# -- ordinary programs --------------------------------------------------------------------


def test_normal_code_returns_stdout_and_exit_zero():
    result = run_python("import math\nprint(math.factorial(10))\nprint('done')")
    assert result.stdout == "3628800\ndone\n"
    assert result.stderr == ""
    assert result.exit_code == 0 and not result.timed_out and result.killed_by is None
    assert result.ok and not result.truncated
    assert result.isolation is not None and result.wall_s < 5


def test_an_interpreter_link_under_tmp_runs_its_target():
    """A virtualenv under /tmp would vanish behind the private tmpfs: its link target runs."""
    with tempfile.TemporaryDirectory(dir="/tmp") as directory:
        link = pathlib.Path(directory) / "python"
        link.symlink_to(os.path.realpath(sys.executable))
        result = run_python("import sys\nprint(sys.version_info[:2])", python=str(link))
    assert result.ok and result.stdout == f"{tuple(sys.version_info[:2])}\n"
    with tempfile.TemporaryDirectory(dir="/tmp") as directory:
        copy = pathlib.Path(directory) / "python"
        copy.write_bytes(b"")
        with pytest.raises(SandboxError, match="private tmpfs"):
            run_python("print(1)", python=str(copy))


def test_syntax_error_gives_nonzero_exit_and_traceback():
    result = run_python("def broken(:\n    pass\n")
    assert result.exit_code != 0
    assert "SyntaxError" in result.stderr and "main.py" in result.stderr
    assert result.killed_by is None and not result.timed_out


def test_exception_traceback_and_exit_code():
    result = run_python("import sys\nprint('before')\nsys.stdout.flush()\n1 / 0")
    assert result.stdout == "before\n"
    assert result.exit_code == 1
    assert "ZeroDivisionError" in result.stderr and "Traceback" in result.stderr
    assert run_python("raise SystemExit(7)").exit_code == 7


def test_bad_arguments_are_rejected_clearly():
    with pytest.raises(TypeError, match="code must be a str"):
        run_python(b"print(1)")
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("pass", memory_mb=1)
    with pytest.raises(ValueError, match="unknown layer"):
        run_python("pass", without={"firewall"})
    with pytest.raises(TypeError, match="collection of layer names"):
        run_python("pass", require="netns")


# -- what is in force, reported honestly --------------------------------------------------


def test_isolation_report_matches_what_the_program_sees():
    code = """
import os, json
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
                  "pids": len([p for p in os.listdir('/proc') if p.isdigit()]),
                  "nnp": open('/proc/self/status').read().split('NoNewPrivs:')[1].split()[0],
                  "ifaces": os.listdir('/sys/class/net') if os.path.isdir('/sys/class/net')
                  else None}))
"""
    result = run_python(code)
    seen, isolation = json.loads(result.stdout), result.isolation
    assert isolation.uid == seen["uid"] and isolation.gid == seen["gid"]
    if os.geteuid() == 0:
        # Root callers never run model code as root.
        assert isolation.dropped_privileges and seen["uid"] != 0 and seen["groups"] in (
            [], [seen["gid"]])
        assert isolation.user == "pool" or isolation.uid == sandbox.NOBODY_UID
    else:
        assert isolation.user == "host" and seen["uid"] == os.geteuid()
    if isolation.fresh_proc:
        assert seen["pids"] <= 3  # init, the program (and at most a transient)
    assert (seen["nnp"] == "1") == isolation.no_new_privs
    assert isolation.network in ("netns", "seccomp", "host")
    assert isolation.describe().startswith(f"uid {isolation.uid}")
    # On a machine where a layer is missing the notes say why.
    for layer, on in [("netns", isolation.network == "netns"),
                      ("pidns", isolation.pid_namespace), ("mountns", isolation.mount_namespace)]:
        assert on or any(note.startswith(layer) for note in isolation.notes)


def test_required_layer_that_is_missing_raises_before_running():
    marker = tempfile.mktemp(prefix="agentrl-never-")
    with pytest.raises(SandboxUnavailableError, match="netns"):
        run_python(f"open({marker!r}, 'w')", require={"netns"}, without={"netns"})
    assert not os.path.exists(marker)
    assert probe_isolation(require={"network"}).network in ("netns", "seccomp")


# -- attack: infinite loop, CPU -------------------------------------------------------------


def test_infinite_loop_times_out_within_slack():
    start = time.monotonic()
    result = run_python("print('started', flush=True)\nwhile True:\n    pass", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert result.timed_out and result.killed_by == "timeout"
    assert result.exit_code == -9
    assert result.stdout == "started\n"  # output before the kill is kept
    assert 1.0 <= elapsed < 1.0 + SLACK_S


def test_cpu_limit_kills_a_busy_program_before_the_wall_clock():
    result = run_python("while True:\n    pass", timeout_s=20.0, cpu_s=1)
    assert result.killed_by == "cpu_limit" and not result.timed_out
    assert result.exit_code == -24  # SIGXCPU at the soft limit


# -- attack: fork bomb ----------------------------------------------------------------------

FORK_BOMB = """
import os
print(os.getcwd(), flush=True)
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


def test_fork_bomb_is_bounded_killed_and_leaves_no_process():
    start = time.monotonic()
    result = run_python(FORK_BOMB, timeout_s=1.0, max_processes=24)
    assert time.monotonic() - start < 1.0 + SLACK_S
    assert result.timed_out and result.killed_by == "timeout"
    assert leftover_processes(result, workdir=workdir_of(result)) == []
    if result.isolation.user == "pool":
        assert pids_of_uid(result.isolation.uid) == []  # not even a zombie
    assert zombie_children() == []


def test_fork_bomb_without_namespaces_is_swept_by_uid(world_python):
    result = run_bare(FORK_BOMB, world_python, timeout_s=1.0, max_processes=24)
    if result is None:
        return
    assert result.timed_out and not result.isolation.pid_namespace
    assert leftover_processes(result, workdir=workdir_of(result)) == []
    if os.geteuid() == 0:
        # The guarantee without a PID namespace: RLIMIT_NPROC on an exclusive uid
        # bounds the bomb, the launcher (a child subreaper) and a uid sweep end it.
        assert result.isolation.user == "pool"
        assert pids_of_uid(result.isolation.uid) == []


# -- attack: huge allocations -------------------------------------------------------------


def test_huge_allocation_hits_the_memory_limit():
    rss_before = rss_mb()
    result = run_python("data = bytearray(2 * 1024**3)\nprint(len(data))", memory_mb=256)
    assert result.exit_code != 0 and result.stdout == ""
    assert result.killed_by == "memory_limit"
    assert "MemoryError" in result.stderr
    assert rss_mb() - rss_before < 50  # the host did not pay for it
    result = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))",
                        memory_mb=256, timeout_s=5)
    assert result.killed_by == "memory_limit" and not result.timed_out


# -- attack: huge outputs -----------------------------------------------------------------


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_huge_output_is_capped_and_the_program_stopped(stream):
    start = time.monotonic()
    result = run_python(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 100000)",
                        max_output_bytes=10000, timeout_s=5)
    assert time.monotonic() - start < SLACK_S
    assert result.truncated and result.killed_by == "output_limit" and not result.timed_out
    assert len(getattr(result, stream)) == 10000 and set(getattr(result, stream)) == {"x"}
    assert result.exit_code == -9


def test_output_below_the_cap_is_complete_and_not_truncated():
    result = run_python("print('y' * 9999, end='')", max_output_bytes=10000)
    assert len(result.stdout) == 9999 and not result.truncated and result.ok


def test_big_file_hits_the_file_size_limit():
    result = run_python("open('big.bin', 'wb').write(b'0' * (8 * 2**20))", max_file_mb=1)
    assert result.killed_by == "file_size_limit" and "File too large" in result.stderr


# -- attack: writing outside its directory --------------------------------------------------

WRITE_ATTACK = """
import json, os
outcome = {}
for path in json.loads(TARGETS):
    try:
        with open(path, "w") as handle:
            handle.write("pwned")
        outcome[path] = "written"
    except OSError as error:
        outcome[path] = error.errno
with open("inside.txt", "w") as handle:
    handle.write("fine")
outcome["inside"] = open("inside.txt").read()
print(os.getcwd())
print(json.dumps(outcome))
"""


def _write_targets(tmp_path):
    tag = uuid.uuid4().hex
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    host_dir.chmod(0o755)
    return {
        "repo": str(ROOT / "agentrl" / f"sandbox-attack-{tag}.py"),
        "host_dir": str(host_dir / f"attack-{tag}"),
        "etc": f"/etc/sandbox-attack-{tag}",
        "tmp": os.path.join(tempfile.gettempdir(), f"sandbox-attack-{tag}"),
        "shm": f"/dev/shm/sandbox-attack-{tag}",
    }


def _check_write_attack(result, targets):
    lines = result.stdout.splitlines()
    outcome = json.loads(lines[1])
    assert outcome["inside"] == "fine"  # its own directory works
    isolation = result.isolation
    protected = (errno.EROFS, errno.EACCES, errno.ENOENT, errno.EPERM)
    for name in ["repo", "host_dir", "etc"]:
        # Read-only mounts (EROFS) or, without them, another uid (EACCES).
        assert outcome[targets[name]] in protected, (name, outcome, isolation)
    if isolation.readonly_root and not targets["repo"].startswith(sandbox.PRIVATE_TMP_DIRS):
        assert outcome[targets["repo"]] == errno.EROFS  # (a checkout under /tmp is hidden)
    # Whatever it wrote in world-writable places is gone: private tmpfs, or swept.
    for path in targets.values():
        assert not os.path.exists(path), path
    assert not os.path.exists(os.path.dirname(lines[0]))


def test_writing_outside_its_directory_fails_or_vanishes(tmp_path):
    targets = _write_targets(tmp_path)
    code = WRITE_ATTACK.replace("TARGETS", repr(json.dumps(list(targets.values()))))
    result = run_python(code)
    assert result.ok, result.stderr
    _check_write_attack(result, targets)
    if result.isolation.private_tmp:
        outcome = json.loads(result.stdout.splitlines()[1])
        assert outcome[targets["tmp"]] == "written"  # into the private tmpfs, then gone


def test_writing_outside_without_namespaces(tmp_path, world_python):
    targets = _write_targets(tmp_path)
    code = WRITE_ATTACK.replace("TARGETS", repr(json.dumps(list(targets.values()))))
    result = run_bare(code, world_python)
    if result is None:
        return
    if os.geteuid() == 0:
        assert not result.isolation.mount_namespace and result.isolation.dropped_privileges
        outcome = json.loads(result.stdout.splitlines()[1])
        assert outcome[targets["repo"]] == errno.EACCES
        assert outcome[targets["tmp"]] == "written"  # allowed, then removed by the uid sweep
        _check_write_attack(result, targets)


# -- attack: reading a 0600 file of the parent ----------------------------------------------

READ_ATTACK = """
import json, sys
try:
    print(json.dumps({"content": open(PATH).read()}))
except OSError as error:
    print(json.dumps({"errno": error.errno}))
"""


@pytest.fixture
def secret_file():
    """A 0600 file of the test's user, in a directory every user may traverse."""
    directory = tempfile.mkdtemp(prefix="agentrl-secret-")
    os.chmod(directory, 0o711)
    path = os.path.join(directory, "secret.txt")
    secret = f"secret-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secret)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.stat(path).st_uid == os.geteuid()
    yield path, secret
    os.unlink(path)
    os.rmdir(directory)


def test_reading_a_0600_file_of_the_parent_fails(secret_file):
    path, secret = secret_file
    result = run_python(READ_ATTACK.replace("PATH", repr(path)))
    assert secret not in result.stdout + result.stderr
    outcome = json.loads(result.stdout)
    isolation = result.isolation
    if isolation.private_tmp and path.startswith(tempfile.gettempdir()):
        assert outcome == {"errno": errno.ENOENT}  # hidden behind the private /tmp
    elif isolation.dropped_privileges:
        assert outcome == {"errno": errno.EACCES}
    else:
        raise AssertionError(f"no layer protects {path}: {isolation}")


def test_reading_a_0600_file_without_namespaces_is_stopped_by_the_uid(secret_file,
                                                                      world_python):
    path, secret = secret_file
    result = run_bare(READ_ATTACK.replace("PATH", repr(path)), world_python)
    if result is None:
        return
    outcome = json.loads(result.stdout)
    if result.isolation.dropped_privileges:
        assert outcome == {"errno": errno.EACCES} and secret not in result.stdout
    else:
        # Documented fallback: a non-root caller without namespaces shares its uid.
        assert outcome == {"content": secret}


# -- attack: reading the parent's environment -----------------------------------------------


def test_the_parents_environment_is_not_visible(monkeypatch):
    secret = f"sk-fake-{uuid.uuid4().hex}"
    monkeypatch.setenv("AGENTRL_FAKE_API_KEY", secret)
    code = f"""
import json, os
outcome = {{"environ": dict(os.environ)}}
for pid in [{os.getpid()}, {os.getppid()}, 1, os.getppid()]:
    for name in ["environ", "cmdline"]:
        try:
            outcome[f"{{pid}}/{{name}}"] = open(f"/proc/{{pid}}/{{name}}", "rb").read().decode(
                "utf-8", "replace")
        except OSError as error:
            outcome[f"{{pid}}/{{name}}"] = error.errno
print(json.dumps(outcome))
"""
    result = run_python(code)
    assert secret not in result.stdout + result.stderr
    outcome = json.loads(result.stdout)
    assert "AGENTRL_FAKE_API_KEY" not in outcome["environ"]
    assert set(outcome["environ"]) <= set(sandbox._PROGRAM_ENV) | {"HOME", "TMPDIR"}
    host_environ = outcome[f"{os.getpid()}/environ"]
    if result.isolation.fresh_proc:
        assert host_environ == errno.ENOENT or secret not in str(host_environ)
    else:
        assert host_environ == errno.EACCES


# -- attack: a socket to a server on 127.0.0.1 ----------------------------------------------


@pytest.fixture
def local_server():
    """A real TCP server on 127.0.0.1 that records every accepted connection."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    accepted = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with connection:
                connection.settimeout(1)
                with contextlib.suppress(OSError):
                    accepted.append(connection.recv(100))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join(timeout=2)
    server.close()


SOCKET_ATTACK = """
import json, socket
try:
    connection = socket.create_connection(("127.0.0.1", PORT), timeout=2)
    connection.sendall(b"exfiltrated")
    connection.close()
    print(json.dumps({"connected": True}))
except OSError as error:
    print(json.dumps({"errno": error.errno}))
"""


@pytest.mark.parametrize("without", [(), ("netns",), ("netns", "seccomp")],
                         ids=["default", "no-netns", "no-netns-no-seccomp"])
def test_socket_to_a_local_server(local_server, without):
    port, accepted = local_server
    result = run_python(SOCKET_ATTACK.replace("PORT", str(port)), without=set(without))
    outcome = json.loads(result.stdout)
    network = result.isolation.network
    if network == "netns":
        assert outcome == {"errno": errno.ENETUNREACH}
    elif network == "seccomp":
        assert outcome == {"errno": errno.EACCES}  # socket() itself is refused
    else:
        # Documented fallback (no netns, no seccomp): loopback is reachable.
        assert outcome == {"connected": True}
        deadline = time.monotonic() + 2
        while not accepted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert accepted == [b"exfiltrated"]
        return
    time.sleep(0.2)
    assert accepted == []
    if "netns" in without:
        assert network != "netns"
    if without == ("netns",):
        # Where seccomp exists (Linux x86_64/aarch64) it is the netns fallback.
        assert network == "seccomp" or any("seccomp" in note for note in result.isolation.notes)


# -- attack: os.system / subprocess ----------------------------------------------------------

SPAWN_ATTACK = """
import json, os, subprocess, sys
print(os.getcwd(), flush=True)
outcome = {"system": os.system("exit 3") >> 8}
outcome["child_uid"] = int(subprocess.run([sys.executable, "-c", "import os; print(os.getuid())"],
                                          capture_output=True, text=True).stdout)
# A detached grandchild that tries to outlive the sandbox.
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "MARKER"],
                 start_new_session=True, stdin=subprocess.DEVNULL,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
children = []
try:
    for _ in range(200):
        children.append(subprocess.Popen(["sleep", "30"]))
    outcome["spawn_error"] = None
except OSError as error:
    outcome["spawn_error"] = error.errno
outcome["spawned"] = len(children)
print(json.dumps(outcome))
"""


def test_os_system_and_subprocess_are_confined():
    marker = f"agentrl-escape-{uuid.uuid4().hex}"
    start = time.monotonic()
    result = run_python(SPAWN_ATTACK.replace("MARKER", marker), max_processes=16, timeout_s=5)
    assert time.monotonic() - start < 5 + SLACK_S and not result.timed_out  # no waiting
    assert result.ok, result.stderr
    workdir = workdir_of(result)
    outcome = json.loads(result.stdout.splitlines()[1])
    assert outcome["system"] == 3
    # Children inherit the sandbox: same unprivileged uid, same limits.
    assert outcome["child_uid"] == result.isolation.uid
    if result.isolation.user in ("pool", "nobody") or result.isolation.user_namespace:
        assert outcome["spawn_error"] == errno.EAGAIN  # RLIMIT_NPROC
        assert outcome["spawned"] < 16
    # Nothing it started survives it, not even the detached grandchild.
    assert leftover_processes(result, workdir=workdir, marker=marker) == []
    assert zombie_children() == []


def test_subprocess_escape_without_namespaces_is_swept(world_python):
    marker = f"agentrl-escape-{uuid.uuid4().hex}"
    result = run_bare(SPAWN_ATTACK.replace("MARKER", marker), world_python, max_processes=16)
    if result is None:
        return
    assert result.ok, result.stderr
    assert not result.isolation.pid_namespace
    outcome = json.loads(result.stdout.splitlines()[1])
    if os.geteuid() == 0:
        assert outcome["spawn_error"] == errno.EAGAIN and outcome["spawned"] < 16
    assert leftover_processes(result, workdir=workdir_of(result), marker=marker) == []


# -- concurrency, cleanup, the host ----------------------------------------------------------


def test_parallel_sandboxes_do_not_interfere():
    normal = """
import os, time
print(os.getcwd())
with open("mine.txt", "w") as handle:
    handle.write("ID")
time.sleep(0.3)
print(os.getuid(), open("mine.txt").read(), sorted(os.listdir(".")))
"""
    jobs = [(normal.replace("ID", str(index)), {}) for index in range(8)]
    jobs.append((FORK_BOMB, {"timeout_s": 1.0}))
    jobs.append(("data = bytearray(2 * 1024**3)", {"memory_mb": 256}))
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(lambda job: run_python(job[0], timeout_s=job[1].pop(
            "timeout_s", 10), **job[1]), jobs))
    workdirs, uids = set(), set()
    for index, result in enumerate(results[:8]):
        assert result.ok, result.stderr
        workdir, last = result.stdout.splitlines()
        uid, content, listing = last.split(" ", 2)
        assert content == str(index) and listing == "['main.py', 'mine.txt']"
        workdirs.add(workdir)
        uids.add(int(uid))
        assert not os.path.exists(os.path.dirname(workdir))
    assert len(workdirs) == 8
    if results[0].isolation.user == "pool":
        assert len(uids) == 8  # each sandbox its own uid: its own RLIMIT_NPROC budget
    assert results[8].killed_by == "timeout"
    assert results[9].killed_by == "memory_limit"


def test_temporary_directories_are_removed_even_on_timeout():
    code = "import os, time\nprint(os.getcwd(), flush=True)\nopen('f', 'w').write('x')\n" \
           "time.sleep(60)"
    result = run_python(code, timeout_s=1.0)
    assert result.timed_out
    base = os.path.dirname(workdir_of(result))
    assert os.path.basename(base).startswith("agentrl-sandbox-")
    assert not os.path.exists(base)
    result = run_python("import os\nprint(os.getcwd())\nos.kill(os.getpid(), 9)")
    assert result.killed_by == "signal:SIGKILL"
    assert not os.path.exists(os.path.dirname(workdir_of(result)))


def test_temporary_directories_are_removed_without_namespaces(world_python):
    code = "import os, time\nprint(os.getcwd(), flush=True)\nopen('f', 'w').write('x')\n" \
           "time.sleep(60)"
    result = run_bare(code, world_python, timeout_s=1.0)
    if result is None:
        return
    assert result.timed_out and not os.path.exists(os.path.dirname(workdir_of(result)))


def test_the_host_survives_every_attack():
    rss_before = rss_mb()
    threads_before = threading.active_count()
    attacks = [
        ("while True:\n    pass", {"timeout_s": 1.0}),
        ("data = bytearray(2 * 1024**3)", {"memory_mb": 256}),
        ("import sys\nwhile True:\n    sys.stdout.write('z' * 65536)", {}),
        (FORK_BOMB, {"timeout_s": 1.0}),
        ("import os\nos.kill(os.getppid(), 9)\nos.kill(1, 9)", {}),
        ("import os, signal\nos.killpg(0, signal.SIGKILL)", {}),
    ]
    for code, options in attacks:
        result = run_python(code, **options)
        assert result.killed_by is not None or result.exit_code != 0 or result.ok
    assert rss_mb() - rss_before < 100
    assert zombie_children() == []
    assert threading.active_count() == threads_before
    assert run_python("print('still fine')").stdout == "still fine\n"


# -- a caller that is not root ----------------------------------------------------------------


NON_ROOT_ATTACK = """
import json, os, socket, subprocess
outcome = {"uid": os.getuid(), "env": sorted(os.environ)}
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1)
    outcome["socket"] = "connected"
except OSError as error:
    outcome["socket"] = error.errno
try:
    open("/etc/agentrl-attack", "w")
    outcome["write"] = "written"
except OSError as error:
    outcome["write"] = error.errno
subprocess.Popen(["sleep", "60"], start_new_session=True)
outcome["spawned"] = 0
try:
    for _ in range(200):
        subprocess.Popen(["sleep", "30"])
        outcome["spawned"] += 1
except OSError as error:
    outcome["spawn_error"] = error.errno
print(json.dumps(outcome))
"""

NON_ROOT_CALLER = """
import dataclasses, json, os
from agentrl.envs.sandbox import run_python
os.environ["AGENTRL_FAKE_API_KEY"] = "sk-inner-secret"
result = run_python(ATTACK, timeout_s=5, max_processes=16, without=WITHOUT)
bomb = run_python(FORK_BOMB, timeout_s=1.0, max_processes=24, without=WITHOUT)
left = []
for pid in os.listdir("/proc"):
    try:
        mine = pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == os.getuid()
        if mine and pid != str(os.getpid()):
            left.append(open(f"/proc/{pid}/stat").read()[:60])
    except OSError:
        pass
print(json.dumps({"caller_uid": os.geteuid(), "result": dataclasses.asdict(result),
                  "bomb_killed_by": bomb.killed_by, "left": left}))
"""


@pytest.mark.parametrize("without", [(), ("userns",)], ids=["userns", "no-userns"])
def test_a_caller_that_is_not_root(without):
    """Runs `run_python` as an unprivileged caller (inside a sandbox, so as a pool uid
    when these tests run as root) and checks the guarantees of that path."""
    inner = NON_ROOT_CALLER.replace("WITHOUT", repr(set(without))).replace(
        "FORK_BOMB", repr(FORK_BOMB)).replace("ATTACK", repr(NON_ROOT_ATTACK))
    result = run_python(inner, timeout_s=15, memory_mb=1024, max_processes=200,
                        env={"PYTHONPATH": str(ROOT)})
    assert result.ok, result.stderr
    report = json.loads(result.stdout)
    inner_result, isolation = report["result"], report["result"]["isolation"]
    outcome = json.loads(inner_result["stdout"])
    assert report["caller_uid"] != 0 or os.geteuid() != 0
    assert isolation["user"] == "host" and outcome["uid"] == report["caller_uid"]
    assert "AGENTRL_FAKE_API_KEY" not in outcome["env"]
    network = isolation["network"]
    assert outcome["socket"] == {"netns": errno.ENETUNREACH, "seccomp": errno.EACCES}.get(
        network, errno.ECONNREFUSED)  # nothing listens on port 9
    # Read-only mounts, or the uid's own permissions on /etc.
    assert outcome["write"] in (errno.EROFS, errno.EACCES)
    # RLIMIT_NPROC bounds spawning (per user namespace, or on top of the caller's tasks).
    assert outcome["spawn_error"] == errno.EAGAIN and outcome["spawned"] < 16
    assert report["bomb_killed_by"] == "timeout"
    if os.geteuid() == 0:
        # Inside the outer sandbox the caller's uid has nothing else running: every
        # process the inner sandboxes started (setsid sleeper, bomb) is gone.
        assert report["left"] == []
    if os.geteuid() == 0 and not without:
        # A pool uid in a root-made sandbox may create user namespaces here.
        assert isolation["user_namespace"] and isolation["pid_namespace"]
        assert network == "netns" and isolation["readonly_root"]
    if without:
        assert not isolation["user_namespace"] and not isolation["pid_namespace"]


# -- the policy-facing tool ------------------------------------------------------------------


def test_python_tool_formats_results_for_the_policy():
    assert python_tool("print(6 * 7)") == "42"
    assert python_tool("pass") == "[no output]"
    text = python_tool("print('partial', flush=True)\nwhile True:\n    pass", timeout_s=1.0)
    assert text.splitlines() == ["partial", "[timed out after 1.0 s]"]
    text = python_tool("data = bytearray(2 * 1024**3)", memory_mb=256)
    assert text.endswith("MemoryError\n[killed: memory limit]")
    text = python_tool("import sys\nwhile True:\n    sys.stdout.write('a' * 1000)",
                       max_output_bytes=5000, max_chars=100)
    assert text.splitlines()[-1] == "[output truncated: the program was stopped]"
    assert "characters cut" in text and len(text) < 300
    text = python_tool("import sys\nprint('out')\nsys.exit(2)")
    assert text == "out\n[exit code 2]"
    assert python_tool("1/0").splitlines()[-2:] == ["ZeroDivisionError: division by zero",
                                                    "[exit code 1]"]
    assert python_tool("pass", without={"netns"}, require={"netns"}).startswith(
        "[sandbox error: required isolation not available")
