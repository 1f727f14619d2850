"""The sandbox holds (LocalSandbox, real namespaces): a disk quota per sandbox, an /etc of its own, no
host path in what the command can read of its own processes and mounts, no host process visible --
as root and, where unprivileged user namespaces are allowed, as an ordinary user."""

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from snowcat.stages.cgroup import CallCgroup
from snowcat.stages.sandbox import Limits, LocalSandbox, disk_usage, sweep_abandoned

CHECKOUT = str(Path(__file__).resolve().parents[1])
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")  # what a command needs, without the interpreter's prefix

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="isolating LocalSandbox tests run as root with util-linux unshare"
)


# everything the sandbox's own /etc holds (stages/sandbox.py, _INIT)
SANDBOX_ETC = {"alternatives", "group", "hostname", "hosts", "ld.so.cache", "nsswitch.conf", "passwd", "resolv.conf"}


def _mounted(path) -> bool:
    return any(line.split()[4] == str(path) for line in Path("/proc/self/mountinfo").read_text().splitlines())


def _py(code: str) -> list[str]:
    return ["python3", "-c", code]


@pytest.fixture
def small():
    """A sandbox with an 8 MiB quota (4096 inodes) and files up to 64 MiB: the quota, not the file size, stops writes."""
    with LocalSandbox(limits=Limits(cpu_s=10, memory_bytes=1 << 30, file_bytes=64 << 20, disk_bytes=8 << 20)) as sb:
        yield sb


def exposed_under_tmp(sb) -> str:
    """What `ls -A /tmp` shows in a fresh call: the mount points of exposed host paths under /tmp
    (the interpreter's venv in a checkout cloned there), nothing a call wrote."""
    names = {Path(p).relative_to("/tmp").parts[0] for p in sb.expose if Path(p).is_relative_to("/tmp/") and os.path.lexists(p)}
    return "".join(f"{name}\n" for name in sorted(names))


# ---------------------------------------------------------------- the disk quota


@needs_root
def test_writes_past_the_quota_fail_inside_and_the_host_holds_no_more(small):
    assert small.disk == "tmpfs"
    tag = f"q{os.getpid()}"
    # Many files, each far below the file-size limit: together past the quota.
    r = small.run("for i in $(seq 100); do head -c 200000 /dev/zero > f$i || { echo stopped at $i; exit 1; }; done", timeout_s=30)
    assert (r.status, r.exit_code) == ("ok", 1) and "No space left on device" in r.stderr, r
    assert 30 <= int(r.stdout.split()[-1]) <= 42, r.stdout  # 8 MiB / 200 kB
    assert disk_usage(small.workdir) <= 8 << 20
    # Full is full in every place the command may write: /tmp and TMPDIR share the quota, and
    # there is no /dev/shm; removing files frees the space again (the quota is the episode's).
    r = small.run(
        f"echo x > /tmp/{tag} || echo tmp-full; echo x > $TMPDIR/{tag} || echo tmpdir-full; echo x > /dev/shm/{tag} || echo no-shm",
        timeout_s=30,
    )
    assert r.stdout.split() == ["tmp-full", "tmpdir-full", "no-shm"], r
    fill = "head -c 3000000 /dev/zero > /tmp/a && head -c 3000000 /dev/zero > $TMPDIR/b && echo fits && head -c 3000000 /dev/zero > c"
    r = small.run(f"rm f*; {fill}", timeout_s=30)  # 6 of 8 MiB in /tmp and TMPDIR already: c does not fit
    assert (r.stdout, r.exit_code) == ("fits\n", 1) and "No space left on device" in r.stderr, r
    # /tmp is each call's own (emptied before it): its space is back for the next
    assert (
        small.run("ls -A /tmp; head -c 1000000 /dev/zero > c && echo ok", timeout_s=30).stdout
        == exposed_under_tmp(small) + "ok\n"
    )
    # nothing went anywhere on the host but into the sandbox's own tmpfs
    assert not any(Path(p, tag).exists() for p in ("/tmp", "/dev/shm", "/var/tmp"))


@needs_root
def test_quota_holds_against_sparse_files_links_inodes_and_fallocate(small):
    probe = (
        "import errno, os, sys\n"
        "def fill(make):\n"
        "    for i in range(100000):\n"
        "        try: make(i)\n"
        "        except OSError as e: return f'{errno.errorcode[e.errno]} at {i}'\n"
        "    return 'never'\n"
        "open('seed', 'w').write('x')\n"
        "print('links', fill(lambda i: os.link('seed', f'l{i}')))\n"  # tmpfs counts hard links as inodes
        "for i in range(100000):\n"
        "    try: os.unlink(f'l{i}')\n"
        "    except FileNotFoundError: break\n"
        "print('files', fill(lambda i: open(f'e{i}', 'w').close()))\n"
        "os.system('rm -f e*')\n"
        "with open('sparse', 'wb') as f:\n"
        "    f.truncate(60 << 20)\n"  # 60 MiB of hole: takes nothing ...
        "print('sparse', os.stat('sparse').st_blocks)\n"
        "try:\n"
        "    with open('sparse', 'r+b') as f: os.posix_fallocate(f.fileno(), 0, 60 << 20)\n"  # ... until filled
        "except OSError as e: print('fallocate', errno.errorcode[e.errno])\n"
        "print('copy', 'failed' if os.system('cat sparse > copy') else 'written')\n"  # a dense copy of the hole
    )
    r = small.run(_py(probe), timeout_s=30)
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert lines["links"].startswith("ENOSPC at ") and int(lines["links"].split()[-1]) < 4096, r
    assert lines["files"].startswith("ENOSPC at ") and int(lines["files"].split()[-1]) < 4096, r
    assert lines["sparse"] == "0" and lines["fallocate"] == "ENOSPC", r
    assert lines["copy"] == "failed" and "No space left on device" in r.stderr, r
    assert disk_usage(small.workdir) <= 8 << 20


@needs_root
@pytest.mark.skipif(CallCgroup.open(1 << 30, 64) is None, reason="needs a writable cgroup (v2 delegated, or v1 as root)")
def test_files_a_call_writes_count_against_its_memory():
    # The quota is a tmpfs: its pages are memory, charged to the call that writes them. Under a
    # 128 MiB call, 200 MiB of files (within the 512 MiB quota) are stopped by the memory limit.
    limits = Limits(cpu_s=10, memory_bytes=128 << 20, file_bytes=512 << 20, disk_bytes=512 << 20)
    with LocalSandbox(limits=limits) as sb:
        r = sb.run("head -c 200000000 /dev/zero > big; echo written", timeout_s=30)
        assert (r.status, r.detail) == ("limit", "memory for the call") and "written" not in r.stdout, r
        # 100 MiB in one call and 100 MiB in the next fit: files of earlier calls are not the call's.
        assert sb.run("rm big; head -c 100000000 /dev/zero > a && echo ok", timeout_s=30).stdout == "ok\n"
        assert sb.run("head -c 100000000 /dev/zero > b && echo ok", timeout_s=30).stdout == "ok\n"


@needs_root
def test_work_dir_persists_and_close_leaves_nothing():
    sb = LocalSandbox(limits=Limits(disk_bytes=4 << 20))
    base, newroot = sb.workdir.parent, None
    assert _mounted(base) and sb.workdir.is_dir() and sb.tmpdir.is_dir()
    assert sb.run("echo 1 > a; echo t > /tmp/t", timeout_s=30).status == "ok"
    newroot = sb._newroot
    # the work dir persists across calls; /tmp is each call's own
    r = sb.run("cat a; ls -A /tmp", timeout_s=30)
    assert r.stdout == "1\n" + exposed_under_tmp(sb), r
    sb.close()
    assert not _mounted(base) and not base.exists() and not Path(newroot).exists()
    sb.close()  # twice is harmless
    # a sandbox dropped without close() is released when collected
    lost = LocalSandbox(limits=Limits(disk_bytes=4 << 20))
    base = lost.workdir.parent
    del lost
    gc.collect()
    assert not _mounted(base) and not base.exists()


KEEP_A_SANDBOX = """
import sys, time
from snowcat.stages.sandbox import Limits, LocalSandbox
sb = LocalSandbox(limits=Limits(disk_bytes=4 << 20))
assert sb.run("echo x > a", timeout_s=30).status == "ok"
print(sb.workdir.parent, sb._newroot, flush=True)
time.sleep(600)
"""


@needs_root
def test_a_killed_processs_sandboxes_are_swept_by_the_next_and_a_living_ones_are_not(tmp_path):
    # As a Slurm job cancelled mid-episode leaves them: SIGKILL, so no close() and no finalizer ran.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    killed = subprocess.Popen([sys.executable, "-c", KEEP_A_SANDBOX], stdout=subprocess.PIPE, text=True, env=env)
    living = subprocess.Popen([sys.executable, "-c", KEEP_A_SANDBOX], stdout=subprocess.PIPE, text=True, env=env)
    try:
        dead_base, dead_root = killed.stdout.readline().split()
        live_base, live_root = living.stdout.readline().split()
        killed.kill()
        killed.wait()
        assert _mounted(dead_base) and Path(dead_root).is_dir()  # what the kill leaves behind
        # A directory named like a sandbox's but of a pid that another process now has, or of another
        # PID namespace, is not taken for a dead one's (its start or namespace differ)...
        reused = tmp_path / f"snowcat-sandbox-{living.pid}-1-{os.stat('/proc/self/ns/pid').st_ino}-x"
        elsewhere = tmp_path / f"snowcat-sandbox-{killed.pid}-1-1-x"
        for d in (reused, elsewhere):
            d.mkdir()
        # a link named as a dead process's sandbox is not followed: what it points at stays whole
        target = tmp_path.parent / f"{tmp_path.name}-target"
        target.mkdir()
        (target / "keep").write_text("x")
        lure = tmp_path / f"snowcat-sandbox-{killed.pid}-1-{os.stat('/proc/self/ns/pid').st_ino}-lure"
        lure.symlink_to(target)
        # ...and the next process that makes a sandbox there sweeps the dead one's, mount and all.
        code = "from snowcat.stages.sandbox import LocalSandbox; LocalSandbox().close()"
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
        assert not _mounted(dead_base) and not Path(dead_base).exists() and not Path(dead_root).exists()
        assert _mounted(live_base) and Path(live_root).is_dir() and elsewhere.is_dir()
        # the pid of `reused` lives, but not since the start it names: it is swept
        assert not reused.exists()
        assert (target / "keep").read_text() == "x"
        lure.unlink()
    finally:
        for proc in (killed, living):
            proc.kill()
            proc.wait()
    # the living one's sandbox, killed in turn, is swept by a direct call too
    assert set(sweep_abandoned(tmp_path)) == {live_base, live_root}
    assert not _mounted(live_base) and [p.name for p in tmp_path.iterdir()] == [elsewhere.name]


# ---------------------------------------------------------------- /etc


@needs_root
def test_the_sandbox_has_its_own_minimal_etc(small):
    host_users = {line.split(":")[0] for line in Path("/etc/passwd").read_text().splitlines() if line}
    r = small.run(
        "ls -A /etc; cut -d: -f1 /etc/passwd; cat /etc/machine-id /etc/shadow /etc/hostname /etc/slurm/slurm.conf /etc/munge/munge.key;"
        " hostname; which awk; echo x > /etc/passwd; ln -s /etc/shadow s; cat s; cat /proc/1/root/etc/passwd",
        timeout_s=30,
    )
    out = r.stdout.splitlines()
    listing = out[: out.index("root")]
    assert set(listing) <= SANDBOX_ETC, r
    assert out[len(listing) : len(listing) + 2] == ["root", "nobody"] and "daemon" not in out, r
    assert host_users - {"root", "nobody"}, "the host has other users to hide"
    assert out[len(listing) + 2 :] == ["sandbox", "sandbox", "/usr/bin/awk"], r  # hostname file and uname
    assert r.stderr.count("No such file") == 5 and "Read-only file system" in r.stderr, r.stderr
    assert "Permission denied" in r.stderr  # pid 1 (root) is not nobody's to look through
    # what the task's tools need still works
    checks = (
        "python3 -c 'import getpass, pwd, ssl, socket; print(getpass.getuser(), pwd.getpwuid(65534).pw_name,"
        " socket.gethostbyname(\"localhost\"))'; bash -lc 'echo login'; git init -q r && git -C r status --short && echo git"
    )
    r = small.run(checks, timeout_s=30)
    assert (r.status, r.exit_code, r.stdout.split()) == ("ok", 0, ["nobody", "nobody", "127.0.0.1", "login", "git"]), r


@needs_root
def test_host_side_writes_do_not_follow_the_commands_symlinks(small):
    small.run("ln -s /etc evil; ln -s /tmp tmp", timeout_s=30)
    for rel in ("evil/x", "tmp/x"):
        r = small.run("true", files={rel: "pwned"})
        assert r.status == "infra_error" and "outside the work dir" in r.detail, r
    assert not Path("/etc/x").exists()


# ---------------------------------------------------------------- host paths and processes


def _leaks(sb) -> str:
    r = sb.run(
        "ps -ef; tr '\\0' ' ' </proc/1/cmdline; cat /proc/self/mountinfo /proc/mounts; tr '\\0' '\\n' </proc/self/environ;"
        " readlink /proc/self/cwd /proc/1/cwd; pwd; cat /proc/self/cgroup",
        timeout_s=30,
    )
    assert r.status == "ok" and "bash -c" in r.stdout and "/workspace" in r.stdout, r
    return r.stdout + r.stderr


@needs_root
@pytest.mark.skipif(not shutil.which("ps"), reason="needs procps ps")
def test_no_host_path_in_processes_mounts_or_environment():
    with LocalSandbox(expose=SYSTEM, limits=Limits(disk_bytes=4 << 20)) as sb:
        seen = _leaks(sb)
        for host in (str(sb.workdir), str(sb.workdir.parent), sb._newroot, CHECKOUT, tempfile.gettempdir() + "/"):
            assert host not in seen, (host, seen)
    # With the interpreter exposed, its prefix is visible at its own path (and only that of the checkout).
    with LocalSandbox(limits=Limits(disk_bytes=4 << 20)) as sb:
        seen = _leaks(sb)
        for host in (str(sb.workdir), sb._newroot):
            assert host not in seen, (host, seen)
        exposed = [p for p in sb.expose if p.startswith(CHECKOUT + "/")]
        assert all(p in exposed for line in seen.splitlines() for p in line.split() if p.startswith(CHECKOUT)), seen


@needs_root
@pytest.mark.skipif(not shutil.which("ps"), reason="needs procps ps")
def test_host_processes_are_invisible(small):
    host = subprocess.Popen(["sleep", "30"])
    try:
        r = small.run(
            f"kill -0 {host.pid} || echo no-such-pid; ls /proc/{host.pid} >/dev/null 2>&1 || echo no-proc; ps -e -o pid=,comm=",
            timeout_s=30,
        )
    finally:
        host.kill()
        host.wait()
    lines = r.stdout.splitlines()
    assert lines[:2] == ["no-such-pid", "no-proc"], r
    procs = [line.split() for line in lines[2:]]
    assert [p[0] for p in procs][0] == "1" and len(procs) <= 4 and "sleep" not in r.stdout, r  # init, sh, ps


# ---------------------------------------------------------------- as an ordinary user

_NONROOT = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from snowcat.stages.sandbox import Limits, LocalSandbox, disk_usage
out = {}
with LocalSandbox(limits=Limits(cpu_s=10, disk_bytes=4 << 20, file_bytes=64 << 20)) as sb:
    out["disk"] = sb.disk
    out["workdir"], out["newroot"] = str(sb.workdir), None
    r = sb.run("id -u; ls -A /etc; cut -d: -f1 /etc/passwd; python3 -c 'import pwd; print(pwd.getpwuid(65534).pw_name)'", timeout_s=30)
    out["etc"] = [r.status, r.stdout, r.stderr]
    r = sb.run("ps -ef; tr '\\0' ' ' </proc/1/cmdline; tr '\\0' '\\n' </proc/1/environ; tr '\\0' '\\n' </proc/self/environ; cat /proc/self/mountinfo", timeout_s=30)
    out["newroot"] = sb._newroot
    out["leaks"] = [r.status, r.stdout, r.stderr]
    r = sb.run("head -c 5000000 /dev/zero > /tmp/big", timeout_s=30)
    out["tmp"] = [r.status, r.exit_code, r.stderr]
    t = time.monotonic()
    r = sb.run("i=0; while :; do i=$((i+1)); head -c 500000 /dev/zero > f$i; sleep 0.02; done", timeout_s=30)
    out["quota"] = [r.status, r.detail, time.monotonic() - t, disk_usage(sb.workdir)]
    t = time.monotonic()  # over the quota from the start (the last call overshot it): no room to grow
    r = sb.run("head -c 3000000 /dev/zero > more; sleep 20", timeout_s=30)
    out["more"] = [r.status, r.detail, time.monotonic() - t]
    r = sb.run("rm f* more; mkdir d; head -c 5000000 /dev/zero > d/x; chmod 000 d", timeout_s=30)  # hidden from the walk?
    out["hidden"] = [r.status, r.detail]
    # over the quota when it starts (the last call overshot it between two looks), and past the
    # watcher's first look before it deletes: a call may still free space
    out["freed"] = sb.run("sleep 1.5; chmod 700 d; rm -r d", timeout_s=30).status
    r = sb.run("head -c 3000000 /dev/zero > a; head -c 3000000 /dev/zero > b; sleep 20", timeout_s=30)
    out["grown"] = [r.status, r.detail]  # and one that then writes past the quota is stopped
print(json.dumps(out))
"""


def _as_user(tmp: Path) -> list[str]:
    """A command line that runs Python as an ordinary user: nobody (via setpriv) when we are root."""
    pythons = [p for p in (os.path.realpath(sys.executable), shutil.which("python3"), "/usr/bin/python3") if p]
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    for py in pythons:
        probe = subprocess.run(
            [*prefix, py, "-c", "import sys; assert sys.version_info >= (3, 10)"],
            capture_output=True,
            cwd=tmp,
            env={"PATH": "/usr/bin:/bin"},
        )
        if probe.returncode == 0:
            return [*prefix, py]
    pytest.skip("no Python >= 3.10 that an ordinary user may run")


@pytest.mark.skipif(not shutil.which("unshare") or not shutil.which("setpriv"), reason="needs util-linux unshare and setpriv")
def test_as_an_ordinary_user():
    # The modules alone, copied where the user can read them (the checkout's venv may sit in /root).
    tmp = Path(tempfile.mkdtemp(prefix="snowcat-nonroot-", dir="/tmp"))
    try:
        for sub, mods in (("stages", ("sandbox.py", "cgroup.py")), ("pipeline", ("procid.py",))):
            pkg = tmp / "snowcat" / sub
            pkg.mkdir(parents=True)
            (pkg / "__init__.py").write_text("")
            for mod in mods:
                shutil.copy(Path(CHECKOUT) / sub / mod, pkg / mod)
        (tmp / "snowcat" / "__init__.py").write_text("")
        for p in [tmp, *tmp.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        user = _as_user(tmp)
        userns = subprocess.run(
            [*user[:-1], "unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True, text=True
        )
        if userns.returncode != 0:
            pytest.skip(f"unprivileged user namespaces are not allowed here: {userns.stderr.strip()}")
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp), "LANG": "C.UTF-8"}
        proc = subprocess.run([*user, "-c", _NONROOT, str(tmp)], capture_output=True, text=True, cwd=tmp, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
    finally:
        shutil.rmtree(tmp)
    assert out["disk"] == "watch"  # no tmpfs on the host without root: the parent watches the work dir
    status, stdout, stderr = out["etc"]
    lines = stdout.split()
    assert status == "ok" and lines[0] == "0" and lines[-3:] == ["root", "nobody", "nobody"], out["etc"]
    assert set(lines[1:-3]) <= SANDBOX_ETC
    # pid 1's argv and environment and the command's own name no host path; mountinfo's root field of
    # /workspace does (a bind mount shows its source's path within its filesystem): only there
    status, stdout, stderr = out["leaks"]
    assert status == "ok" and "bash -c" in stdout, out["leaks"]
    for host in (out["workdir"], out["newroot"], CHECKOUT):
        hits = [line for line in stdout.splitlines() if host in line]
        assert all(line.split()[3] == out["workdir"] and line.split()[4] == "/workspace" for line in hits), (host, hits)
    assert out["tmp"][:2] == ["ok", 1] and "No space left on device" in out["tmp"][2], out[
        "tmp"
    ]  # the private /tmp: min(64 MiB, quota)
    status, detail, took, used = out["quota"]
    assert (status, detail) == ("limit", f"disk {4 << 20} bytes for the work dir"), out["quota"]
    assert took < 10 and used < 16 << 20, out["quota"]  # stopped within a poll or two of passing the quota
    assert out["hidden"] == ["limit", f"disk {4 << 20} bytes for the work dir"] and out["freed"] == "ok", out
    assert out["grown"] == ["limit", f"disk {4 << 20} bytes for the work dir"], out
    assert out["more"][:2] == ["limit", f"disk {4 << 20} bytes for the work dir"] and out["more"][2] < 10, out
