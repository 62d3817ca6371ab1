"""The Python sandbox (envs/tools/sandbox.py): every hostile program runs in a real sandboxed process (namespaces,
an unprivileged uid, rlimits) and ends as a sandbox failure; a benign program's output and a raising program's
traceback are output. Then each hostile program, called as `<python>` at the end of a model turn in the
replica's environment loop (services/rollout/batch.py, real TorchEngine), ends as a failed group: retried, then
dropped with reason "sandbox" logged, while the other group completes. After every test no sandbox process is
left (psutil)."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from structlog.testing import capture_logs

from laminar.envs.tools.sandbox import PythonSandbox, SandboxLimits, SandboxUnavailable, run_python

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root (docs/guides/tools.md, 'The Python sandbox')")

# Small limits keep the tests quick; wall_s is the timing bound's unit.
LIMITS = SandboxLimits(wall_s=2.0, cpu_s=30, memory_bytes=512 << 20, output_bytes=64 << 10, processes=16)
SLACK_S = 1.5  # after the wall clock: SIGKILL of the namespace's init, its teardown, reaping (measured ~0.1 s)


@pytest.fixture(autouse=True)
def no_leftovers():
    """No process of the sandbox uid range and no new child of this process (zombie or orphan) after each test;
    children that were there before it (the session's dev servers, in a full run) are not the test's."""
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    yield
    lo, hi = LIMITS.uid_base, LIMITS.uid_base + LIMITS.uid_count
    deadline = time.monotonic() + 2.0
    while True:
        left = [p for p in psutil.process_iter(["uids", "status"]) if p.info["uids"] and lo <= p.info["uids"].real < hi]
        children = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
        if not left and not children or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"sandbox processes left: {[(p.pid, p.info['status']) for p in left]}"
    assert not children, f"children left: {[(c.pid, c.status()) for c in children]}"


@pytest.fixture
def listener():
    """A TCP listener on 127.0.0.1 in the host's network namespace, counting connections it accepts."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    accepted: list[object] = []

    def serve():
        try:
            while True:
                accepted.append(srv.accept())
        except OSError:
            pass

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1], accepted
    srv.close()


def test_a_benign_program_returns_its_output():
    r = run_python("import os\nprint(sum(range(10)))\nprint(os.getuid(), os.getcwd(), sorted(os.environ))\n"
                   "open('out.txt', 'w').write('kept in its own directory')\nprint(open('out.txt').read())", LIMITS)
    assert r.ok and r.exit_code == 0 and r.isolated, r
    lines = r.output.splitlines()
    uid = int(lines[1].split()[0])
    # 45 = 0 + 1 + ... + 9; an unprivileged uid of the range; its private working directory; an empty
    # environment (Python itself sets only LC_CTYPE, PEP 538 locale coercion)
    assert lines[0] == "45" and LIMITS.uid_base <= uid < LIMITS.uid_base + LIMITS.uid_count
    assert lines[1].split()[1] == "/tmp/work" and lines[1].split(maxsplit=2)[2] in ("[]", "['LC_CTYPE']")
    assert lines[2] == "kept in its own directory"


def test_a_program_that_raises_is_output_not_a_failure():
    r = run_python("print('before')\nraise ValueError('boom')", LIMITS)
    assert r.ok and r.exit_code == 1
    assert r.output.startswith("before\nTraceback (most recent call last):")
    assert 'File "/tmp/work/main.py", line 2' in r.output and r.output.endswith("ValueError: boom\n")
    assert "exec(" not in r.output  # the sandbox's own frame is not shown
    out = PythonSandbox(LIMITS).run("raise ValueError('boom')")
    assert out.ok and "ValueError: boom" in out.output and "[exit code 1]" in out.output


def test_a_program_that_loops_forever_is_killed_at_the_wall_clock():
    t0 = time.monotonic()
    r = run_python("while True:\n    pass", LIMITS)
    took = time.monotonic() - t0
    assert (r.failure, r.exit_code) == ("timeout", None), r
    # wall_s = 2.0 s: killed at 2.0 s (the clock starts before the sandbox does), so 2.0 <= took < 2.0 + 1.5
    assert LIMITS.wall_s <= took < LIMITS.wall_s + SLACK_S, took


def test_a_cpu_bound_program_past_its_cpu_seconds_is_killed():
    # RLIMIT_CPU = 1 s: SIGXCPU at 1 s of CPU, SIGKILL at 2 s; the wall clock (20 s) leaves room on a loaded host
    r = run_python("while True:\n    pass", SandboxLimits(wall_s=20.0, cpu_s=1))
    assert r.failure == "cpu" and "SIGXCPU" in r.detail, r


def test_a_program_that_allocates_10_gb_fails_on_memory():
    r = run_python("x = bytearray(10 * 1024**3)\nprint('allocated')", LIMITS)  # 10 GiB > RLIMIT_AS 512 MiB
    assert r.failure == "memory" and "allocated" not in r.output, r


def test_a_fork_bomb_fails_on_processes_without_starving_the_host():
    t0 = time.monotonic()
    r = run_python("import os\nwhile True:\n    os.fork()", LIMITS)
    assert r.failure == "processes" and "process limit" in r.detail, r
    # the first refused fork (16 processes of its uid) ends it, long before the 2 s wall clock
    assert time.monotonic() - t0 < LIMITS.wall_s
    # and this process can still fork (RLIMIT_NPROC counts the sandbox's own uid only)
    assert run_python("print('fine')", LIMITS).output == "fine\n"


def test_a_program_that_opens_a_socket_fails_and_reaches_nothing(listener):
    port, accepted = listener
    with socket.create_connection(("127.0.0.1", port), timeout=2):  # the listener works from the host
        pass
    time.sleep(0.1)
    assert len(accepted) == 1
    r = run_python(f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('connected')", LIMITS)
    assert r.failure == "network" and f"127.0.0.1', {port}" in r.detail and "connected" not in r.output, r
    # the kernel stops it too: past the audit hook (ctypes), connect() in its namespace has no route
    r = run_python(f"""import ctypes, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
s = socket.socket()
addr = struct.pack('=HH4s8x', socket.AF_INET, socket.htons({port}), socket.inet_aton('127.0.0.1'))
rc = libc.connect(s.fileno(), addr, len(addr))
print(rc, ctypes.get_errno())""", LIMITS)
    assert r.ok and r.output.split()[0] == "-1" and int(r.output.split()[1]) in (101, 111), r  # ENETUNREACH/ECONNREFUSED
    time.sleep(0.1)
    assert len(accepted) == 1  # only the host's own connection ever arrived


@pytest.mark.parametrize("target", ["/tmp/laminar-sandbox-escape.txt", "/var/tmp/laminar-sandbox-escape.txt",
                                    "/dev/shm/laminar-sandbox-escape.txt",
                                    str(Path(__file__).resolve().parent / "laminar-sandbox-escape.txt"),
                                    "../escape.txt"])
def test_a_program_that_writes_outside_its_directory_fails_and_writes_nothing(target):
    host = target if target.startswith("/") else "/tmp/escape.txt"
    Path(host).unlink(missing_ok=True)
    r = run_python(f"open({target!r}, 'w').write('escaped')\nprint('wrote')", LIMITS)
    assert r.failure == "write" and "outside /tmp/work" in r.detail and "wrote" not in r.output, r
    # the kernel stops it too (past the audit hook): /tmp is the sandbox's root-owned tmpfs, the rest read-only
    r = run_python(f"""import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.open({os.path.abspath(os.path.join("/tmp/work", target)).encode()!r}, os.O_WRONLY | os.O_CREAT, 0o644)
print(fd, ctypes.get_errno())""", LIMITS)
    # /tmp is the sandbox's root-owned tmpfs: EACCES (13); every other directory is not in its root: ENOENT (2)
    path = os.path.abspath(os.path.join("/tmp/work", target))
    refused = 13 if os.path.dirname(path) == "/tmp" else 2
    assert r.ok and r.output.split() == ["-1", str(refused)], r
    assert not Path(host).exists()


def test_its_working_directory_is_the_only_writable_directory_it_can_see():
    # access(W_OK) checks permissions and read-only mounts; every directory but /proc and /sys (~1.4 s)
    r = run_python("import os\nprint([d for d, _, _ in os.walk('/') if not d.startswith(('/proc', '/sys'))"
                   " and os.access(d, os.W_OK)])", replace(LIMITS, wall_s=60.0))
    assert r.ok and r.output == "['/tmp/work']\n", r


def test_a_program_that_prints_100_mb_is_killed_at_the_output_cap():
    # one 100 MB write: building and encoding the string takes ~0.1 s idle but over 1 s on the loaded 2-core
    # machine, so the wall clock is 10 s here; "output" (not "timeout") shows the cap killed it
    r = run_python("import sys\nsys.stdout.write('x' * 100_000_000)\nprint('done')", replace(LIMITS, wall_s=10.0))
    assert r.failure == "output" and r.exit_code is None, r
    assert len(r.output) == LIMITS.output_bytes and set(r.output) == {"x"}  # what came back is cut at the cap
    r = run_python("while True:\n    print('y' * 1000)", LIMITS)  # many small writes: the same
    assert r.failure == "output"


def test_orphans_and_new_sessions_die_with_the_sandbox():
    # a child in a new session (out of reach of a process-group kill) sleeping past the program's end
    r = run_python("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')",
                   LIMITS)
    assert r.ok and r.output == "parent done\n"  # returns at once; the fixture checks the child is gone


def test_sandboxes_run_concurrently_each_with_its_own_uid():
    results: list = [None] * 3
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run_python(
        "import os, time\ntime.sleep(0.3)\nprint(os.getuid())", LIMITS))) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.ok for r in results)
    assert len({r.output for r in results}) == 3  # three different uids


def test_a_program_cannot_make_the_supervisor_kill_another_process_group():
    # the supervisor SIGKILLs the group whose pid the report pipe names: a program writing a decoy's pid there
    # (to every fd it has) and then running into the wall clock must not get the decoy killed
    decoy = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        r = run_python(f"""import os
for fd in range(3, 64):
    try:
        os.write(fd, b"pid\\t{decoy.pid}\\n")
    except OSError:
        pass
while True:
    pass""", LIMITS)
        assert r.failure == "timeout", r
        assert decoy.poll() is None, "the decoy was killed"
    finally:
        decoy.kill()
        decoy.wait()


def test_the_explicit_weaker_mode_runs_with_limits_only(monkeypatch):
    # as if without root: allow_unsandboxed=True runs it without namespaces or a uid change, still with the
    # rlimits, the wall clock, the output cap and a private temporary directory (removed afterwards)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    weak = SandboxLimits(wall_s=2.0, cpu_s=30, output_bytes=64 << 10, allow_unsandboxed=True)
    r = run_python("import os\nprint(os.getcwd())", weak)
    assert r.ok and not r.isolated and "laminar-sandbox-" in r.output
    assert not os.path.exists(r.output.strip())
    assert run_python("while True:\n    pass", weak).failure == "timeout"
    assert run_python("print('x' * 100_000)", weak).failure == "output"


def test_without_root_it_refuses_with_what_is_missing(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailable, match="needs root .* allow_unsandboxed=True"):
        run_python("print(1)", LIMITS)
    with pytest.raises(SandboxUnavailable, match="needs root"):
        PythonSandbox(LIMITS)


# -- each hostile program as a failed group, through the replica's failure path -----------------------------

HOSTILE = {
    "loop": "while True:\n    pass",
    "memory": "x = bytearray(10 * 1024**3)",
    "fork": "import os\nwhile True:\n    os.fork()",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
    "write": "open('/tmp/laminar-sandbox-escape.txt', 'w').write('escaped')",
    "print": "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)",  # 100 MB, 1 MB a write
}
FAILURE = {"loop": "timeout", "memory": "memory", "fork": "processes", "socket": "network", "write": "write",
           "print": "output"}


GROUP_LIMITS = SandboxLimits(wall_s=1.0, cpu_s=30, memory_bytes=512 << 20, processes=16)


def _python_task(hostile: str):
    """The `tools` task with the `<python>` tool in place of the calculator. The tiny word-level tokenizer cannot
    spell a program, so the task's reading of a model turn (`turn_text`, the text the environment loop parses
    for a call) gives `<calc> 1 </calc>` as a `<python>` call of the hostile program and `<calc> 2 </calc>` as a
    call of `print('ok')`; any other turn is read as it is."""
    from laminar.envs.tasks.tool_use import ToolsTask

    class PythonTask(ToolsTask):
        def __init__(self) -> None:
            super().__init__(seed=0)
            self.tools = [PythonSandbox(GROUP_LIMITS, probe=False)]

        def turn_text(self, turn_ids):
            text = super().turn_text(turn_ids).strip()
            program = {"<calc>1</calc>": hostile, "<calc>2</calc>": "print('ok')"}.get(text.replace(" ", ""))
            return text if program is None else f"<python>{program}</python>"

    return PythonTask()


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_each_hostile_program_ends_as_a_failed_group_retried_then_dropped(kind):
    from laminar.contract import Lease
    from laminar.rl.engine_api import Finished
    from laminar.services.rollout.batch import Batch
    from tests.test_tools import _engine

    task = _python_task(HOSTILE[kind])
    engine, retries = _engine(), 2
    batch = Batch(engine, task, "run-t", "rollout-0", group_size=2, clock=time.monotonic, max_group_retries=retries)

    def call_turn(group_id: str, n: int) -> Finished:
        """Sample 0 of `group_id` ending its first turn with the call `<calc> n </calc>` <eos>, played by hand
        (the model's other samples run in the real engine)."""
        turn = [*task.tokenizer.encode(f"<calc> {n} </calc>", add_special_tokens=False).ids, task.eos_id]
        engine.abort([f"{group_id}/0"])
        return Finished(f"{group_id}/0", batch.groups[group_id].prompt.token_ids, turn, [-0.5] * len(turn), "stop")

    with capture_logs() as logs:
        batch.admit([Lease("hostile", 0), Lease("benign", 1)])
        batch.record([call_turn("benign", 2)])  # print('ok'): its output goes back into the engine
        for _attempt in range(1 + retries):  # each try's sample 0 calls the hostile program
            assert "hostile" in batch.groups and not batch.failed
            batch.record([call_turn("hostile", 1)])
        steps = 0
        while engine.in_flight():  # the run goes on: the benign group's samples finish in the engine
            batch.record(engine.step())
            steps += 1
            assert steps < 200, "the batch never drained"
    # the hostile group: 1 + 2 tries, each a sandbox failure of this kind, then dropped with reason "sandbox"
    assert [(f.group_id, f.reason, f.attempts) for f in batch.failed] == [("hostile", "sandbox", 1 + retries)]
    assert batch.failed[0].detail.startswith(f"python {FAILURE[kind]}:"), batch.failed[0].detail
    executed = [e for e in logs if e["event"] == "tool_executed" and e["group_id"] == "hostile"]
    assert [(e["tool"], e["ok"]) for e in executed] == [("python", False)] * (1 + retries)
    retried = [e for e in logs if e["event"] == "group_retried"]
    dropped = [e for e in logs if e["event"] == "group_failed"]
    assert [(e["group_id"], e["reason"], e["attempt"]) for e in retried] == [("hostile", "sandbox", 1),
                                                                             ("hostile", "sandbox", 2)]
    assert [(e["group_id"], e["reason"], e["attempts"]) for e in dropped] == [("hostile", "sandbox", 3)]
    # the benign group completed, its sample 0 with the tool's answer in its response (masked as tool output)
    assert [g.lease.group_id for g in batch.completed] == ["benign"]
    done = batch.completed[0].done[0]
    assert done.extra["tool_calls"] == "1" and done.extra["tool_names"] == "python" and 0 in done.tool_mask
    assert not Path("/tmp/laminar-sandbox-escape.txt").exists()
