"""A Harbor environment whose "container" is a private namespace over a per-trial directory tree.

No Docker engine exists on the CPU rig, yet the trial, the agent's run command and the verifier must
be Harbor's real ones. So each trial gets a root dir (`$RIG_SANDBOX_DIR/<session>-xxxx/`) holding its
own /app, /logs/{agent,verifier,artifacts}, /tests, /installed-agent, /root ($HOME) and /tmp, and one
long-lived "init" process that lives in fresh mount + pid namespaces chrooted into that tree. Every
`exec` joins those namespaces with `nsenter`, so concurrent trials cannot see each other's files,
the host's files are visible only where bound read-only (/usr, /etc, the Python carrying the agent),
and background processes persist between execs exactly as in a container until `stop()` kills init,
which takes the whole pid namespace down with it. The network is the host's: the agent must reach
the capture proxy on 127.0.0.1.

The pre-installed agent starts warm. A real sandbox pays the agent's start-up (mini-swe-agent imports litellm:
~5 CPU-seconds) on its own CPUs; here every trial shares the host's two cores with the trainer, the engine and the
server, and the suite runs hundreds of rollouts. So the image's `mini-swe-agent` is a launcher that asks one process
per server, which has imported litellm once, to fork the agent into the launcher's own namespaces, root, working
directory, credentials, environment and stdio, and run the real console script there with the same argv
(agent_zygote.py says what keeps that the same as a cold start, and when it starts cold instead). The agent lives in
the trial's pid namespace like anything else it started, so `stop()` still takes it down.

Needs root (or CAP_SYS_ADMIN) plus util-linux `unshare`/`nsenter`; `preflight()` says so up front.
The Dockerfile is never built: only its WORKDIR is honoured. Tasks needing packages must find them
on the host.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path, PurePosixPath

import agent_zygote
from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities

SANDBOX_DIR = Path(os.environ.get("RIG_SANDBOX_DIR", "/tmp/rig-sandboxes"))

# The venv whose console scripts play the role of agents pre-installed in the image. Defaults to
# the server's own interpreter, which is where mini-swe-agent was installed from PyPI.
AGENT_VENV = Path(os.environ.get("RIG_AGENT_VENV", sys.prefix))
PREINSTALLED = ("mini-swe-agent", "mini")

# What `docker exec` would inherit from a slim image, and nothing from the server: the server's
# environment holds engine keys and OPENENV_* settings a task must never see.
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    # The image is offline; without this litellm tries GitHub for its cost map on every start.
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    # mini-swe-agent gives up on the first failed model call: its own 10 attempts, up to 60 s apart, would outlast a
    # test's agent timeout (the capture proxy has retried the engine by then).
    "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
}

SKELETON = (
    "logs/agent", "logs/verifier", "logs/artifacts", "tests", "installed-agent",
    "root", "var/tmp", "proc", "dev",
)  # fmt: skip

# Runs as pid 1 of the new namespaces: bind the host trees read-only, give the sandbox its own
# /proc and a minimal /dev, then chroot and block on stdin. The server holds stdin's write end, so
# if the server dies the read returns, init exits, and the kernel reaps the whole sandbox.
_INIT = r"""set -e
R=$1; shift
for p in "$@"; do mount --rbind "$p" "$R$p"; mount -o remount,bind,ro "$R$p"; done
mount -t proc proc "$R/proc"
mount -t tmpfs -o mode=755 tmpfs "$R/dev"
for d in null zero full random urandom tty; do
  [ -e "/dev/$d" ] || continue
  touch "$R/dev/$d"; mount --bind "/dev/$d" "$R/dev/$d"
done
ln -s /proc/self/fd "$R/dev/fd"
for i in 0:stdin 1:stdout 2:stderr; do ln -s "fd/${i%%:*}" "$R/dev/${i#*:}"; done
mkdir "$R/dev/shm"; mount -t tmpfs tmpfs "$R/dev/shm"
exec chroot "$R" /bin/sh -c 'echo ready; read _'
"""


def _read_only_trees() -> list[str]:
    """Host trees bound into every sandbox: the OS, plus the Python the pre-installed agent runs on."""
    trees: list[str] = []
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc"):
        if Path("/", top).is_dir() and not Path("/", top).is_symlink():
            trees.append(f"/{top}")
    for extra in (AGENT_VENV, Path(sys.base_prefix)):
        real = os.path.realpath(extra)
        if not any(real == t or real.startswith(t + "/") for t in trees):
            trees.append(real)
    return trees


def _agent_python() -> str:
    """The interpreter of the pre-installed console scripts (their shebang)."""
    with open(AGENT_VENV / "bin" / PREINSTALLED[0], "rb") as f:
        return f.readline()[2:].decode().strip()


_warm_agent: tuple[str, int, subprocess.Popen] | None = None


def _warm_agent_socket() -> str:
    """The socket of this server's warm agent process, started by the first sandbox. It lives as long as this
    process: it leaves when the pipe's write end, held only here, closes."""
    global _warm_agent
    if _warm_agent is None:
        name = f"agh-rig-agent-{os.getpid()}-{os.urandom(6).hex()}"
        lifetime, keep = os.pipe()
        scripts = [str(AGENT_VENV / "bin" / n) for n in PREINSTALLED if (AGENT_VENV / "bin" / n).exists()]
        process = subprocess.Popen(
            [_agent_python(), str(Path(agent_zygote.__file__).resolve()), name, str(lifetime), *scripts],
            stdin=subprocess.DEVNULL, pass_fds=(lifetime,), env=BASE_ENV, cwd="/", start_new_session=True,
        )  # fmt: skip
        os.close(lifetime)
        _warm_agent = (name, keep, process)
    return _warm_agent[0]


def _child_pid(parent: int) -> int | None:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                return int(entry)
    return None


def _kill_group(process: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class LocalSandbox(BaseEnvironment):
    """One trial's sandbox: a private root tree, entered through namespaces."""

    @staticmethod
    def type() -> str:
        return "local"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities()

    @classmethod
    def preflight(cls) -> None:
        missing = [tool for tool in ("unshare", "nsenter", "chroot", "mount") if not shutil.which(tool)]
        if missing:
            raise SystemExit(f"local sandbox needs util-linux tools: {', '.join(missing)}")
        # Root is not enough inside an unprivileged container: ask the kernel, so a CI job without
        # CAP_SYS_ADMIN sees `local` reported unusable instead of every rollout failing at start.
        probe = subprocess.run(
            ["unshare", "--mount", "--pid", "--fork", "--propagation", "private",
             "mount", "-t", "proc", "proc", "/proc"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if probe.returncode != 0:
            raise SystemExit(f"local sandbox needs mount+pid namespaces (root): {probe.stderr.strip()}")

    def _validate_definition(self) -> None:
        pass  # nothing is built, so no Dockerfile is required

    def _workdir(self) -> str:
        if self.task_env_config.workdir:
            return self.task_env_config.workdir
        dockerfile = self.environment_dir / "Dockerfile"
        if dockerfile.is_file():
            found = re.findall(r"^\s*WORKDIR\s+(\S+)", dockerfile.read_text(), re.M | re.I)
            if found:
                return found[-1]
        return "/"

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self, force_build: bool) -> None:
        SANDBOX_DIR.mkdir(parents=True, exist_ok=True)
        self._root = Path(tempfile.mkdtemp(prefix=f"{self.session_id[:60]}-", dir=SANDBOX_DIR))
        self._root.chmod(0o755)  # it is "/" inside: a non-root agent user must be able to traverse it
        self._procs: set[asyncio.subprocess.Process] = set()
        self._cwd = self._workdir()
        trees = _read_only_trees()
        for rel in (*SKELETON, self._cwd.lstrip("/"), *(t.lstrip("/") for t in trees)):
            (self._root / rel).mkdir(parents=True, exist_ok=True)
        (self._root / "tmp").mkdir(mode=0o1777, exist_ok=True)
        os.chmod(self._root / "tmp", 0o1777)
        for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            if Path("/", top).is_symlink():  # merged-/usr hosts: keep the same shape inside
                (self._root / top).symlink_to(os.readlink(Path("/", top)))
        # The "image" ships the agent pre-installed where Harbor's run command looks for it: a launcher that starts
        # the real console script from the rig's warm process (agent_zygote.py).
        bin_dir = self._root / "root/.local/bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name in PREINSTALLED:
            if (AGENT_VENV / "bin" / name).exists():
                launcher = bin_dir / name
                launcher.write_text(agent_zygote.LAUNCHER.format(
                    python=_agent_python(), socket=_warm_agent_socket(), script=str(AGENT_VENV / "bin" / name)))
                launcher.chmod(0o755)

        self._init = await asyncio.create_subprocess_exec(
            "unshare", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private",
            "sh", "-c", _INIT, "rig-init", str(self._root), *trees,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        line = await asyncio.wait_for(self._init.stdout.readline(), timeout=30)
        self._init_pid = _child_pid(self._init.pid)
        if line.strip() != b"ready" or self._init_pid is None:
            _kill_group(self._init)
            err = (await self._init.stderr.read()).decode(errors="replace")
            raise RuntimeError(f"local sandbox failed to start: {err.strip()[:400]}")
        await self._upload_environment_dir_after_start()

    async def stop(self, delete: bool) -> None:
        for process in list(getattr(self, "_procs", ())):
            _kill_group(process)
        init = getattr(self, "_init", None)
        if init is not None and init.returncode is None:
            _kill_group(init)  # --kill-child: init dies, and every process in its pid namespace
            await init.wait()
        # The bind mounts only ever existed inside the dead namespace, so this sees plain dirs.
        if delete and getattr(self, "_root", None):
            shutil.rmtree(self._root, ignore_errors=True)

    # --- exec -----------------------------------------------------------------------------------
    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        argv = ["nsenter", f"--target={self._init_pid}", "--mount", "--pid", "--root", "--wd"]
        full_env = {**BASE_ENV, **(self._merge_env(env) or {})}
        user = self._resolve_user(user)
        if user not in (None, "root", 0):
            entry = pwd.getpwuid(user) if isinstance(user, int) else pwd.getpwnam(user)
            argv += [f"--setuid={entry.pw_uid}", f"--setgid={entry.pw_gid}"]
            full_env.setdefault("HOME", entry.pw_dir)
        # `--wd=DIR` would be resolved on the host, so the shell changes directory after the chroot.
        script = f"cd -- {shlex.quote(cwd or self._cwd)} || exit 1\n{command}"
        process = await asyncio.create_subprocess_exec(
            *argv, "/bin/bash", "-c", script,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=full_env, cwd="/", start_new_session=True,
        )  # fmt: skip
        self._procs.add(process)
        try:
            out, err = await asyncio.wait_for(process.communicate(), timeout=timeout_sec)
        except asyncio.TimeoutError:
            _kill_group(process)
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds") from None
        except BaseException:
            _kill_group(process)  # a cancelled agent phase must not leave its command running
            raise
        finally:
            self._procs.discard(process)
        return ExecResult(
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            return_code=process.returncode or 0,
        )

    # --- file transfer: plain copies, with paths resolved as the sandbox would see them ----------
    def _host(self, path: str) -> Path:
        """Map a sandbox path into the trial tree, following symlinks as the chroot would.

        Resolving on the host instead would let an agent's `/logs/agent/x -> /etc/shadow` reach the
        server's own files on download.
        """
        parts, current, hops = list(PurePosixPath("/", path).parts[1:]), self._root, 0
        while parts:
            name = parts.pop(0)
            if name in ("", "."):
                continue
            if name == "..":
                current = current.parent if current != self._root else current
                continue
            candidate = current / name
            if candidate.is_symlink():
                hops += 1
                if hops > 40:
                    raise OSError(f"too many symlinks resolving {path}")
                target = PurePosixPath(os.readlink(candidate))
                if target.is_absolute():
                    current, target = self._root, target.relative_to("/")
                parts = list(target.parts) + parts
                continue
            current = candidate
        return current

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        target = self._host(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source_path, target)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        shutil.copytree(source_dir, self._host(target_dir), dirs_exist_ok=True)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(self._host(source_path), target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        shutil.copytree(self._host(source_dir), target_dir, symlinks=True, dirs_exist_ok=True)


class UnreachableSandbox(LocalSandbox):
    """A backend that is down: every start fails, as a cloud sandbox does with an outage or a revoked key.

    Listed as usable, like a backend whose credentials are present but whose service fails at run time.
    """

    async def start(self, force_build: bool) -> None:
        raise ConnectionError("sandbox backend unreachable (rig: local-down)")


class RefusedSandbox(LocalSandbox):
    """A backend whose plan refuses every sandbox, raising what the e2b SDK raises for the API's answer
    (e2b/api/__init__.py): `concurrency`, its 429 at the plan's concurrent-sandbox limit; `lifetime`, its 400 for a
    sandbox timeout beyond the plan's cap (Harbor asks 24 h). The messages are e2b's API's own."""

    async def start(self, force_build: bool) -> None:
        from e2b.exceptions import RateLimitException, SandboxException

        if os.environ.get("RIG_SANDBOX_REFUSAL") == "lifetime":
            raise SandboxException("400: Timeout cannot be greater than 1 hours")
        raise RateLimitException("429: Rate limit exceeded, please try again later. - you have reached the maximum "
                                 "number of concurrent E2B sandboxes (20). If you need more, please contact us at "
                                 "'https://e2b.dev/docs/getting-help'")
