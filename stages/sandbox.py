"""Sandboxes that run an agent's tool calls: no network, writes only in a work dir, hard limits.

`Sandbox.run(cmd, files, timeout_s)` returns a SandboxResult whose `status` separates what the model
did from what the machinery did: "ok" (the command ran; its exit code is the model's business),
"timeout" (wall time), "limit" (CPU time, file size or output cap hit), "infra_error" (the sandbox
itself failed: unshare missing, work dir gone, namespace setup refused). Infra errors are not model
failures: RL treats them as neutral and evaluation reports their rate instead of counting them as fails.

LocalSandbox, what it guarantees when running as root (the isolating mode, `isolate=True`):
  * network: the command runs in a fresh network namespace (`unshare --net`): only a loopback
    device, down. Nothing on the host, including 127.0.0.1 servers of the parent, is reachable;
    abstract unix sockets belong to the network namespace and are unreachable too.
  * filesystem: the command sees a root of its own (a tmpfs, `pivot_root`) holding only the
    `expose`d host paths, read-only (by default the system's /usr, /bin, /sbin, /lib* and the
    running interpreter's prefixes), an /etc of its own, a private /proc,
    /dev/{null,zero,full,random,urandom} (no /dev/shm), a /tmp emptied before each call (an
    exposed path under the host's /tmp, a venv in a checkout there, is mounted inside it), and the
    work dir, writable, at `/workspace` (as in the Apptainer sandbox: paths in tool output do not
    depend on where the host keeps the episode; `inside=` names another place, e.g. SWE-bench's
    `/testbed`, `check_inside`). Nothing else on the host exists for it: no other
    checkout, no /tmp of the host, no filesystem unix socket of another process (a socket file is
    reachable by path: hiding the path is the only way to refuse it).
    The command runs as uid/gid 65534 (nobody) with no capabilities and no_new_privs, so it
    cannot remount or leave the root.
  * /etc: written for each call, read-only: passwd and group with root and nobody only, hosts with
    localhost, an empty resolv.conf, nsswitch.conf (files), hostname `sandbox` (also the UTS
    namespace's, set with hostname(1) where it exists); from the host only the dynamic linker's cache (ld.so.cache) and, bound read-only,
    /etc/alternatives (Debian's awk, which, vi ... are symlinks through it). The host's users,
    machine-id, Slurm/munge/ssh configuration are not there. `expose=(..., "/etc")` puts the
    host's back.
  * disk: `Limits.disk_bytes` (default 1 GiB) caps everything the episode's calls write: the work
    dir is on a tmpfs of that size (and 1 inode per 8 KiB) mounted on the host for the sandbox's
    lifetime (`Sandbox.disk == "tmpfs"`) and unmounted by close() (or when the object is
    collected; a process killed outright leaves it to the next one's `sweep_abandoned`); the
    call's /tmp is a directory on the same tmpfs, and TMPDIR is inside the work dir. A write past
    it fails inside (ENOSPC; the command fails, status "ok" with its exit code),
    and nothing lands on the host's disk at all. Hard links count as inodes, sparse files as what
    they hold. A tmpfs is memory: its pages are charged to the memory cgroup of whoever writes
    them, so the files a call writes count against that call's whole-call memory limit (past it:
    OOM kill, "limit" "memory for the call"), those of earlier calls against the pipeline's own
    group; a sandbox may hold `memory_bytes + disk_bytes` of the machine's memory.
  * host paths: pid 1 is re-exec'd once the root is built, so `ps`, /proc/1/cmdline and
    /proc/*/environ carry no host path, and the command's cwd is /workspace. /proc/self/mountinfo
    shows each mount's source path within its filesystem: the work dir's is `/work` on the quota
    tmpfs; an exposed path is shown at its own path (the interpreter's prefix, which may sit in a
    checkout, included); the sandbox root's host path never.
  * processes: fresh PID, UTS and IPC namespaces: the command sees only its own processes; when the
    wall time is up, the namespace's init is killed and the kernel kills every process left in it,
    including ones that escaped the process group.
  * resources, for the call as a whole where a cgroup can be made (`stages.cgroup`: v2 with
    delegation, or v1 as root): memory incl. swap, process count, CPU seconds summed over every
    process of the call. Per process, always (setrlimit before exec): CPU seconds, address
    space, file size; process count only where no cgroup caps the call (RLIMIT_NPROC counts the
    uid's processes host-wide, so calls running side by side would share it); the parent caps stdout+stderr and kills the command when it
    writes more. Where no cgroup can be made (`Sandbox.caps == "rlimit"`), a call of N processes
    may hold N times the memory limit.
Without root (`os.geteuid() != 0`) the same namespaces are made inside an unprivileged user
namespace (`unshare --user --map-root-user`, needs unprivileged user namespaces) and the command
keeps the user's own uid (0 inside, mapped to the user) with all capabilities dropped. What differs:
no tmpfs can be mounted on the host, so the work dir stays a host directory and the quota is
watched, not enforced by the kernel (`Sandbox.disk == "watch"`): the parent measures the work dir
(st_blocks, each inode once) every 0.5 s or so while a call runs and after it, and stops the call
past the quota ("limit", "disk N bytes for the work dir"): while it runs, once it holds more than
the quota and more than it held when the call began (a call that starts over the quota, where an
earlier one overshot between two looks, may still delete); after it, whenever the work dir ends
over the quota. So the host may briefly hold what a
command writes between two looks, and a file deleted while still open is not seen (it goes when the
call's PID namespace does, at the latest; each is at most file_bytes); /tmp is a private tmpfs of min(64 MiB, disk_bytes) per call;
mountinfo's source path of /workspace is the work dir's host path. A work dir passed in by the
caller is watched the same way in every mode (its contents must outlive the sandbox).
`isolate=False` keeps only the limits and the private work dir (with its quota): for trusted
commands and machines that refuse namespaces. ApptainerSandbox gets the isolation from `apptainer
exec --containall --net --network none --writable-tmpfs`: the image's own /etc (plus what
apptainer.conf binds: hosts, localtime, the user's passwd/group entry), a PID namespace, and the
work dir bound at /workspace with the same quota (tmpfs as root, else watched); the writable
overlay and the contained /tmp are a tmpfs of apptainer.conf's `sessiondir max size`.
"""

from __future__ import annotations

import os
import re
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from snowcat.pipeline import procid
from snowcat.stages.cgroup import CallCgroup

STATUSES = ("ok", "timeout", "limit", "infra_error")
WORKSPACE = "/workspace"  # where an isolating sandbox shows the work dir (unless told another: `inside=`)
NOBODY = 65534
# Where the work dir may not be shown: the sandbox's own system paths (and the root).
RESERVED = ("/", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/usr", "/etc", "/dev", "/proc", "/sys", "/tmp", "/run", "/var")


def check_inside(path: str) -> str:
    """`path` if it can be where a sandbox shows its work dir: absolute, normal, without spaces or ':',
    and neither a system path nor under one (ValueError otherwise)."""
    norm = os.path.normpath(path) if isinstance(path, str) and path.startswith("/") else ""
    if (
        norm != path
        or any(c.isspace() for c in path)
        or ":" in path
        or any(path == r or path.startswith(r + "/") for r in RESERVED if r != "/")
        or path == "/"
    ):
        raise ValueError(f"a sandbox work dir must be an absolute, normal path outside the system's (e.g. /testbed): {path!r}")
    return path


@dataclass
class SandboxResult:
    status: str  # one of STATUSES
    exit_code: int | None
    stdout: str
    stderr: str
    truncated: bool = False  # output was cut at the cap
    detail: str = ""  # which limit, or what broke in the sandbox machinery


@dataclass
class Limits:
    cpu_s: int = 60
    memory_bytes: int = 4 << 30  # address space
    file_bytes: int = 256 << 20  # largest file the command may write
    nproc: int = 256
    output_bytes: int = 1 << 20  # stdout + stderr kept; more kills the command
    disk_bytes: int = 1 << 30  # the episode's work dir + /tmp (+ TMPDIR, inside the work dir), all files together


@dataclass(frozen=True)
class Bind:
    """A host directory one call sees at `inside` (absolute), read-only unless `writable`."""

    host: str
    inside: str
    writable: bool = False

    def __post_init__(self) -> None:
        for path in (self.host, self.inside):
            if not os.path.isabs(path) or any(c.isspace() for c in path) or ":" in path:
                raise ValueError(f"sandbox bind paths must be absolute, without spaces or ':': {path!r}")


TMP_BYTES = 64 << 20  # the private /tmp of a call where the work dir has no quota mount (at most disk_bytes)


def _mount_quota(base: str, disk_bytes: int) -> bool:
    """Mount a tmpfs of `disk_bytes` (and as many inodes as 8 KiB files) on `base`; False where refused."""
    opts = f"size={disk_bytes},nr_inodes={max(4096, disk_bytes // 8192)},mode=0700"
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "snowcat-sandbox", base], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _owner_prefix(kind: str) -> str:
    """The prefix of this process's sandbox directories (`kind`: "" or "root-"): its pid, start and
    PID namespace, so that `sweep_abandoned` can tell a directory whose process is gone."""
    me = procid.identify()
    return f"snowcat-sandbox-{kind}{me['pid']}-{me['start']}-{_pid_namespace()}-"


_OWNED = re.compile(r"snowcat-sandbox-(?:root-)?(\d+)-(\d+)-(\d+)-")
_swept: set[str] = set()


def _mount_points() -> set[str]:
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return set()
    # field 5 is the mount point, with space, tab, newline and backslash as octal escapes
    return {re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4]) for line in lines}


def sweep_abandoned(root: str | os.PathLike | None = None) -> list[str]:
    """Unmount and remove the sandbox directories under `root` (default: the temp dir) whose process is
    gone: one killed outright (SIGKILL, a Slurm job cancelled or out of memory) never closes its
    sandboxes, and as root each held a tmpfs mounted on the host. Only this PID namespace's (there a
    pid means this process table's), and only what this user may remove. The paths removed."""
    root = str(root or tempfile.gettempdir())
    me, ours, mounts, removed = procid.identify(), _pid_namespace(), None, []
    try:
        entries = [e.path for e in os.scandir(root) if _OWNED.match(e.name)]
    except OSError:
        return removed
    for path in entries:
        pid, start, namespace = map(int, _OWNED.match(os.path.basename(path)).groups())
        if namespace != ours or procid.alive({**me, "pid": pid, "start": start}):
            continue  # another namespace's, or its process lives (this host, this boot)
        mounts = _mount_points() if mounts is None else mounts
        if path in mounts:
            _release(path, True, os.getpid())
            if os.path.ismount(path):
                continue
        else:
            shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed


def _sweep_once() -> None:
    """`sweep_abandoned` in the temp dir, once per process (what dies later is swept by a later one)."""
    root = tempfile.gettempdir()
    if root not in _swept:
        _swept.add(root)
        sweep_abandoned(root)


def _release(base: str, mounted: bool, owner: int) -> None:
    """Unmount the quota tmpfs (lazily if something still holds it) and remove its mount point; only
    in the process that made it (a forked child exiting must not take its parent's sandbox)."""
    if os.getpid() != owner:
        return
    if mounted:
        for args in (["umount", base], ["umount", "-l", base]):
            try:
                if subprocess.run(args, capture_output=True, timeout=30).returncode == 0:
                    break
            except (OSError, subprocess.SubprocessError):
                pass
        else:
            return  # still mounted: never rmtree into a live tmpfs from here
    shutil.rmtree(base, ignore_errors=True)


def _scandir(path: str):
    try:
        return os.scandir(path)
    except PermissionError:  # a directory the command closed (chmod 000): ours to open again
        try:
            os.chmod(path, os.lstat(path).st_mode & 0o7777 | 0o700)
            return os.scandir(path)
        except OSError:
            return None
    except OSError:
        return None


def disk_usage(root: str | os.PathLike) -> int:
    """Bytes allocated under `root` (st_blocks, each inode once: hard links and sparse files count what
    they take), symlinks not followed; a directory made unreadable is made readable for its owner."""
    seen, total, stack = set(), 0, [str(root)]
    while stack:
        it = _scandir(stack.pop())
        if it is None:
            continue
        with it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
    return total


# The namespaces' init (pid 1) runs in two stages. Stage 1 (bash, still privileged) builds the root
# and is the only one that sees host paths. Arguments: the stage-2 script, the work dir, the host dir
# shown as /tmp ("-": a private tmpfs of `tmp_size` bytes), its size, the (empty) directory to build
# the new root on, the ':'-separated host paths to expose read-only, where the work dir appears, the
# uid to become, the extra binds ("ro|rw SRC DST" lines, or empty), the fd to report readiness on,
# then the command. It ends by exec'ing stage 2 with only the uid, the fd and the command, so pid 1's argv and environment (`ps`, /proc/1/cmdline,
# /proc/1/environ) name no host path. The command runs as a child of stage 2, not exec'd: pid 1
# ignores signals it has no handler for, which would swallow SIGXCPU.
_INIT = r"""
set -eu
stage2=$1 work=$2 tmp=$3 tmp_size=$4 new=$5 expose=$6 inside=$7 uid=$8 binds=$9 ready_fd=${10}; shift 10
die() { echo "sandbox-init: $*" >&2; exit 125; }
mount --make-rprivate / || die "cannot make mounts private"
mount -t tmpfs -o mode=755,size=4m sandbox-root "$new" || die "cannot mount the sandbox root on $new"
# the sandbox's own /etc: users root and nobody, localhost, no name servers; from the host only the
# linker's cache and, read-only, /etc/alternatives (Debian's awk, which, vi ... are symlinks through it)
mkdir -p "$new/etc/alternatives"
printf '%s\n' root:x:0:0:root:/workspace:/bin/sh nobody:x:65534:65534:nobody:/workspace:/usr/sbin/nologin >"$new/etc/passwd"
printf '%s\n' root:x:0: nogroup:x:65534: >"$new/etc/group"
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$new/etc/hosts"
printf '%s\n' 'passwd: files' 'group: files' 'shadow: files' 'hosts: files' >"$new/etc/nsswitch.conf"
: >"$new/etc/resolv.conf"
echo sandbox >"$new/etc/hostname"
if [ -f /etc/ld.so.cache ]; then cp /etc/ld.so.cache "$new/etc/"; fi
if [ -d /etc/alternatives ]; then mount --rbind /etc/alternatives "$new/etc/alternatives" || die "cannot expose /etc/alternatives"; fi
hostname sandbox 2>/dev/null || echo sandbox 2>/dev/null >/proc/sys/kernel/hostname || true  # the UTS namespace's
# the /tmp first: exposed paths under /tmp (a venv in a checkout there) are mounted inside it
mkdir -p "$new/tmp"
if [ "$tmp" = - ]; then
  mount -t tmpfs -o "mode=1777,size=$tmp_size" sandbox-tmp "$new/tmp" || die "cannot mount /tmp"
else
  mount --bind "$tmp" "$new/tmp" || die "cannot bind /tmp"
fi
IFS=:
for p in $expose; do
  [ -e "$p" ] || [ -L "$p" ] || continue
  mkdir -p "$new$(dirname "$p")"
  if [ -L "$p" ]; then cp -P "$p" "$new$p"; continue; fi  # e.g. /bin -> usr/bin on merged-/usr systems
  if [ -d "$p" ]; then mkdir -p "$new$p"; else touch "$new$p"; fi
  mount --rbind "$p" "$new$p" || die "cannot expose $p"
done
unset IFS
# every exposed mount (submounts too) read-only; /tmp stays writable
for mp in $(awk -v r="$new/" 'index($5, r) == 1 {print $5}' /proc/self/mountinfo); do
  [ "$mp" = "$new/tmp" ] && continue
  mount -o remount,bind,ro "$mp" || die "cannot make $mp read-only"
done
mkdir -p "$new/dev" "$new/proc"
for d in null zero full random urandom; do
  touch "$new/dev/$d" && mount --bind "/dev/$d" "$new/dev/$d" || die "cannot expose /dev/$d"
done
mount -t proc proc "$new/proc" || die "cannot mount /proc"
mkdir -p "$new$inside"
mount --bind "$work" "$new$inside" || die "cannot bind $work"
# extra host dirs of this call ("ro|rw SRC DST" lines): e.g. a verifier's /tests and /logs/verifier
if [ -n "$binds" ]; then
  printf '%s\n' "$binds" | while read -r mode src dst; do
    mkdir -p "$new$dst" && mount --bind "$src" "$new$dst" || die "cannot bind $dst"
    if [ "$mode" = ro ]; then mount -o remount,bind,ro "$new$dst" || die "cannot make $dst read-only"; fi
  done
fi
cd "$new" && mkdir .old && PATH="/usr/sbin:/sbin:$PATH" pivot_root . .old || die "cannot pivot to the sandbox root"
umount -l /.old && rmdir /.old || die "cannot detach the host root"
mount -o remount,bind,ro / || die "cannot make the sandbox root read-only"
touch /.sandbox-ro-check 2>/dev/null && die "root still writable after remount"
cd "$inside" || die "work dir $inside unavailable"
unset OLDPWD  # the host path of the new root
exec bash -c "$stage2" sandbox-init "$uid" "$ready_fd" "$@"
"""
_INIT_STAGE2 = r"""
uid=$1 ready_fd=$2; shift 2
if [ "$uid" = keep ]; then
  drop="setpriv --inh-caps=-all --bounding-set=-all --no-new-privs --"
else
  drop="setpriv --reuid=$uid --regid=$uid --clear-groups --inh-caps=-all --bounding-set=-all --no-new-privs --"
fi
echo ready >&"$ready_fd"
eval "exec $ready_fd>&-"
$drop "$@"
exit $?
"""


def default_exposed() -> tuple[str, ...]:
    """What a tool call sees of the host by default: the system's programs and libraries and the
    running interpreter (so `sys.executable` and its packages work inside). Not /etc: the sandbox
    gets its own (users root and nobody, localhost, the linker cache, /etc/alternatives)."""
    system = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")
    pythons = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
    return system + tuple(sorted(p for p in pythons if not any(p == s or p.startswith(s + "/") for s in system)))


# Where no namespace init reports readiness, this wrapper does, just before exec. bash, not sh:
# dash cannot name file descriptors above 9.
_READY = 'echo ready >&{fd}; exec {fd}>&-; exec "$@"'


def write_files(root: str | os.PathLike, files: dict[str, str | bytes]) -> None:
    """Write {relative path: content} under `root` (made if missing); a path that leaves it is refused."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for rel, content in files.items():
        path = (root / rel).resolve()
        if not path.is_relative_to(root.resolve()):
            raise ValueError(f"file '{rel}' is outside the work dir {root}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)


def _limit_status(code: int | None) -> str | None:
    for sig in (signal.SIGXCPU, signal.SIGXFSZ):
        if code in (-sig, 128 + sig):
            return signal.Signals(sig).name
    return None


class Sandbox:
    """A place to run tool calls; one per agent episode, holding its work dir between calls."""

    def __init__(self, workdir: str | os.PathLike | None = None, limits: Limits | None = None, inside: str = WORKSPACE) -> None:
        self.limits = limits or Limits()
        self._inside = check_inside(inside)
        self.caps = "rlimit"  # "cgroup-v1" | "cgroup-v2" once a call got a group: how whole-call limits hold
        # How disk_bytes holds: "tmpfs" (root: the work dir and /tmp live on a tmpfs of that size, mounted
        # on the host for the sandbox's lifetime) or "watch" (the parent measures the work dir while a
        # call runs and stops it past the quota).
        self.disk = "watch"
        self.tmpdir: Path | None = None  # host dir shown as the call's /tmp (on the quota tmpfs), else a private tmpfs
        self._binds: tuple[Bind, ...] = ()  # the current call's (run(binds=))
        if workdir is not None:
            self.workdir = Path(workdir)
            self._finalizer = None
            return
        _sweep_once()
        base = tempfile.mkdtemp(prefix=_owner_prefix(""))
        mounted = os.geteuid() == 0 and _mount_quota(base, self.limits.disk_bytes)
        self._finalizer = weakref.finalize(self, _release, base, mounted, os.getpid())
        if mounted:
            self.disk = "tmpfs"
            self.workdir = Path(base) / "work"
            self.tmpdir = Path(base) / "tmp"
            self.workdir.mkdir()
            self.tmpdir.mkdir(mode=0o1777)
            self.tmpdir.chmod(0o1777)
        else:
            self.workdir = Path(base)

    @property
    def inside(self) -> str:
        """The work dir's path as the command sees it."""
        return self._inside

    def command(self, cmd: list[str] | str, ready_fd: int | None = None) -> list[str]:
        raise NotImplementedError

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # unmount the quota tmpfs, remove the work dir

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _preexec(self, group: CallCgroup | None) -> None:
        if group is not None:
            group.attach()
        lim = self.limits
        resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (lim.memory_bytes, lim.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_bytes, lim.file_bytes))
        if group is None:
            # RLIMIT_NPROC counts every process of the uid on the host, so it couples calls that run
            # side by side as nobody: only the fallback when no group caps this call's own pids.
            resource.setrlimit(resource.RLIMIT_NPROC, (lim.nproc, lim.nproc))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    def _env(self) -> dict[str, str]:
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.inside,
            "TMPDIR": f"{self.inside}/.tmp",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }

    def _prepare(self) -> None:
        """Hook run before each call (e.g. hand the work dir to the sandbox uid)."""

    def _group(self) -> CallCgroup | None:
        """The cgroup capping one call as a whole (None: only per-process rlimits hold)."""
        group = CallCgroup.open(self.limits.memory_bytes, self.limits.nproc)
        if group is not None:
            self.caps = "cgroup-v2" if group.v2 else "cgroup-v1"
        return group

    def run(
        self,
        cmd: list[str] | str,
        files: dict[str, str | bytes] | None = None,
        timeout_s: float = 60.0,
        binds: tuple[Bind, ...] = (),
    ) -> SandboxResult:
        """Run one tool call in the work dir; `files` ({relative path: content}) are written first;
        `binds`: host directories this call alone sees (a verifier's /tests, /logs/verifier)."""
        self._binds = tuple(binds)
        try:
            if not self.workdir.is_dir():
                raise FileNotFoundError(f"work dir {self.workdir} unavailable")
            write_files(self.workdir, files or {})
            (self.workdir / ".tmp").mkdir(exist_ok=True)
            if self.tmpdir is not None:  # each call gets an empty /tmp
                for entry in os.scandir(self.tmpdir):
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path)
                    else:
                        os.unlink(entry.path)
            self._prepare()
            ready_r, ready_w = os.pipe()
        except (OSError, ValueError) as e:
            return SandboxResult("infra_error", None, "", "", detail=f"sandbox setup: {e}")
        at_start = disk_usage(self.workdir) if self.disk == "watch" else 0
        group = self._group()
        try:
            argv = self.command(cmd, ready_w)
            proc = subprocess.Popen(
                argv,
                cwd=self.workdir,
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(ready_w,),
                start_new_session=True,
                preexec_fn=lambda: self._preexec(group),
            )
        except (OSError, subprocess.SubprocessError) as e:
            os.close(ready_r)
            if group is not None:
                group.remove()
            return SandboxResult("infra_error", None, "", "", detail=f"sandbox start: {e}")
        finally:
            os.close(ready_w)
        try:
            return self._collect(proc, ready_r, timeout_s, group, at_start)
        finally:
            if group is not None:
                group.remove()

    def _collect(
        self, proc: subprocess.Popen, ready_r: int, timeout_s: float, group: CallCgroup | None = None, at_start: int = 0
    ) -> SandboxResult:
        """The call's result; `at_start`: what the work dir held when it began (a watched quota)."""
        cap = self.limits.output_bytes
        out = {proc.stdout: bytearray(), proc.stderr: bytearray()}
        sel = selectors.DefaultSelector()
        for stream in out:
            sel.register(stream, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        status, detail, truncated = "ok", "", False
        watch = self.disk == "watch"
        next_watch = time.monotonic() + 0.5
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                status, detail = "timeout", f"wall time {timeout_s}s"
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                out[key.fileobj] += chunk
                if sum(len(b) for b in out.values()) > cap:
                    status, detail, truncated = "limit", f"output over {cap} bytes", True
            if group is not None and status == "ok" and group.cpu_seconds() > self.limits.cpu_s:
                status, detail = "limit", f"cpu {self.limits.cpu_s}s for the call"
            if watch and status == "ok" and time.monotonic() >= next_watch:
                t0 = time.monotonic()
                if self._over_disk(at_start):
                    status, detail = "limit", f"disk {self.limits.disk_bytes} bytes for the work dir"
                # a walk of a big tree is not free: poll at most a tenth of the time
                next_watch = time.monotonic() + max(0.5, 10 * (time.monotonic() - t0))
            if status != "ok":
                break
        if status != "ok":
            self._kill(proc)
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()) if status == "ok" else 10)
        except subprocess.TimeoutExpired:  # output closed but the process lingers past the wall time
            status, detail = "timeout", f"wall time {timeout_s}s"
            self._kill(proc)
            proc.wait()
        sel.close()
        for stream in out:
            stream.close()
        os.set_blocking(ready_r, False)  # never wait on a writer that somehow survived
        try:
            ready = os.read(ready_r, 16)
        except BlockingIOError:
            ready = b""
        os.close(ready_r)
        stdout, stderr = (bytes(b) for b in out.values())
        if len(stdout) + len(stderr) > cap:
            truncated = True
            stdout = stdout[:cap]
            stderr = stderr[: max(0, cap - len(stdout))]
        code = proc.returncode
        if not ready.startswith(b"ready"):
            # The command never started: whatever failed is the sandbox's fault, not the model's.
            return SandboxResult(
                "infra_error",
                code,
                "",
                stderr.decode(errors="replace"),
                detail=f"sandbox did not start (exit {code}): {stderr.decode(errors='replace').strip()[-300:]}",
            )
        if status == "ok" and (which := _limit_status(code)):
            status, detail = "limit", which
        if status == "ok" and group is not None and (which := group.hit()):
            status, detail = "limit", f"{which} for the call"
        if status == "ok" and watch and self._over_disk():
            status, detail = "limit", f"disk {self.limits.disk_bytes} bytes for the work dir"
        return SandboxResult(status, code, stdout.decode(errors="replace"), stderr.decode(errors="replace"), truncated, detail)

    def _over_disk(self, held: int = 0) -> bool:
        """The work dir holds more than the quota (and more than `held`)."""
        return disk_usage(self.workdir) > max(self.limits.disk_bytes, held)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class LocalSandbox(Sandbox):
    """Tool calls as host processes in fresh namespaces (see the module docstring for guarantees)."""

    def __init__(
        self,
        workdir: str | os.PathLike | None = None,
        limits: Limits | None = None,
        isolate: bool = True,
        unshare: str = "unshare",
        expose: tuple[str, ...] | None = None,
        inside: str = WORKSPACE,
    ) -> None:
        super().__init__(workdir, limits, inside)
        self.isolate = isolate
        self.unshare = unshare
        self.expose = tuple(expose) if expose is not None else default_exposed()
        bad = [p for p in self.expose if not os.path.isabs(p) or ":" in p]
        if bad:
            raise ValueError(f"sandbox expose paths must be absolute without ':': {bad}")
        self.root = os.geteuid() == 0
        self._newroot: str | None = None  # an empty host dir the calls' private roots are mounted on

    def close(self) -> None:
        if self._newroot:
            shutil.rmtree(self._newroot, ignore_errors=True)
        super().close()

    @property
    def inside(self) -> str:
        return self._inside if self.isolate else str(self.workdir)

    def _prepare(self) -> None:
        if self.isolate and self.root:
            # The command runs as nobody: give it (only) its work dir.
            os.chown(self.workdir, NOBODY, NOBODY)
            for p in self.workdir.rglob("*"):
                os.lchown(p, NOBODY, NOBODY)
            for bind in self._binds:
                if bind.writable:
                    os.chown(bind.host, NOBODY, NOBODY)

    def _group(self) -> CallCgroup | None:
        return super()._group() if self.isolate else None

    def command(self, cmd: list[str] | str, ready_fd: int | None = None) -> list[str]:
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not self.isolate:
            if self._binds:
                raise OSError("binds need an isolating sandbox (isolate=True)")
            # No namespace init to report readiness: the wrapper reports it just before exec.
            return ["bash", "-c", _READY.format(fd=ready_fd), "sandbox", *argv]
        ns = ["--net", "--mount", "--pid", "--uts", "--ipc", "--fork", "--kill-child", "--mount-proc"]
        if not self.root:
            ns = ["--user", "--map-root-user", *ns]
        uid = str(NOBODY) if self.root else "keep"
        if self._newroot is None:  # made once, reused by every call (each mounts its root privately)
            self._newroot = tempfile.mkdtemp(prefix=_owner_prefix("root-"))
        tmp = str(self.tmpdir) if self.tmpdir is not None else "-"
        tmp_size = str(min(TMP_BYTES, self.limits.disk_bytes))
        binds = "\n".join(f"{'rw' if b.writable else 'ro'} {b.host} {b.inside}" for b in self._binds)
        init = [_INIT_STAGE2, str(self.workdir), tmp, tmp_size, self._newroot, ":".join(self.expose), self.inside, uid, binds]
        return [self.unshare, *ns, "bash", "-c", _INIT, "sandbox-init", *init, str(ready_fd), *argv]


class ApptainerSandbox(Sandbox):
    """Tool calls inside the sandbox image: `apptainer exec --containall --net --network none ...`.

    --containall: private /tmp, /dev, IPC and PID namespaces and a clean environment; --no-home: the
    user's home is not mounted; --net --network none: only loopback; --writable-tmpfs: the image
    is read-only, scratch writes land in a throwaway overlay; the work dir (at /workspace, or
    `inside`: SWE-bench's images want their repository at /testbed, over the image's own copy) is
    the only host path.
    """

    def __init__(
        self,
        image: str | os.PathLike,
        workdir: str | os.PathLike | None = None,
        limits: Limits | None = None,
        apptainer: str = "apptainer",
        inside: str = WORKSPACE,
    ) -> None:
        super().__init__(workdir, limits, inside)
        self.image = str(image)
        self.apptainer = apptainer

    def command(self, cmd: list[str] | str, ready_fd: int | None = None) -> list[str]:
        # Resolved here, on the caller's PATH (often a module's): the command's own PATH is the
        # sandbox's. Not found: the wrapper would report ready and then fail to exec -- the machinery's failure.
        binary = shutil.which(self.apptainer) if ready_fd is not None else self.apptainer
        if binary is None:
            raise FileNotFoundError(f"{self.apptainer} not found on PATH")
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        inner = [
            binary,
            "exec",
            "--containall",
            "--no-home",
            "--net",
            "--network",
            "none",
            "--writable-tmpfs",
            "--bind",
            f"{self.workdir}:{self.inside}",
            *[a for b in self._binds for a in ("--bind", f"{b.host}:{b.inside}" + ("" if b.writable else ":ro"))],
            "--pwd",
            self.inside,
            self.image,
            *argv,
        ]
        if ready_fd is None:
            return inner
        # Readiness is reported by the host-side wrapper; an apptainer start-up failure is then
        # told apart from the command's by apptainer's own exit code 255 and its FATAL line.
        return ["bash", "-c", _READY.format(fd=ready_fd), "sandbox", *inner]

    def _collect(self, proc, ready_r, timeout_s, group=None, at_start=0):
        result = super()._collect(proc, ready_r, timeout_s, group, at_start)
        if result.status == "ok" and result.exit_code == 255 and "FATAL:" in result.stderr:
            result.status, result.detail = "infra_error", "apptainer failed to start the sandbox image"
        return result


def open_sandbox(
    image: str | None = None, limits: Limits | None = None, workdir: str | os.PathLike | None = None, inside: str = WORKSPACE
) -> Sandbox:
    """The sandbox a tool call or a verification runs in: the image's (Apptainer) when one is set, else
    host processes in namespaces; the work dir is shown at `inside`."""
    if image:
        return ApptainerSandbox(image, workdir=workdir, limits=limits, inside=inside)
    return LocalSandbox(workdir=workdir, limits=limits, inside=inside)


def strip_git_history(repo_dir: str | os.PathLike, base_commit: str) -> str:
    """Leave `repo_dir` with nothing an agent could mine for the answer: only `base_commit` and its
    ancestors stay reachable or even stored.

    HEAD becomes a `main` branch at base_commit; every other branch, tag, remote, note, stash and
    reflog is deleted; objects borrowed from elsewhere (alternates) are copied in and the link cut;
    then every unreachable object is pruned, so a fix commit's sha cannot be `git show`n.
    Returns the full sha of the base commit.
    """
    repo = Path(repo_dir)

    def git(*args: str, check: bool = True) -> str:
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise RuntimeError(f"git {' '.join(args)} in {repo}: {proc.stderr.strip()}")
        return proc.stdout.strip()

    sha = git("rev-parse", "--verify", f"{base_commit}^{{commit}}")
    git("checkout", "--quiet", "--force", "--detach", sha)
    for ref in git("for-each-ref", "--format=%(refname)").splitlines():
        git("update-ref", "--no-deref", "-d", ref)
    git("checkout", "--quiet", "-B", "main", sha)
    for remote in git("remote").splitlines():
        git("remote", "remove", remote)
    gitdir = Path(git("rev-parse", "--absolute-git-dir"))
    for name in ("FETCH_HEAD", "ORIG_HEAD", "MERGE_HEAD", "CHERRY_PICK_HEAD", "packed-refs.lock"):
        (gitdir / name).unlink(missing_ok=True)
    shutil.rmtree(gitdir / "logs", ignore_errors=True)
    shutil.rmtree(gitdir / "refs" / "original", ignore_errors=True)
    git("reflog", "expire", "--expire=now", "--all")
    # Copy what we still need from alternates, then cut them; repack keeps only reachable objects.
    git("repack", "-a", "-d", "-q")
    (gitdir / "objects" / "info" / "alternates").unlink(missing_ok=True)
    git("-c", "gc.reflogExpire=now", "-c", "gc.reflogExpireUnreachable=now", "gc", "--prune=now", "--quiet")
    git("prune", "--expire=now")
    return sha
