"""A warm start for the pre-installed agent of the rig's sandbox stand-in (local_sandbox.py).

Every mini-swe-agent start imports litellm: ~5 CPU-seconds, on the CPU rig's two cores, for each of the suite's
hundreds of rollouts. A real sandbox pays that start-up on its own CPUs, not the host's, so the rig pays it once
per Harbor server instead. This process (started once, by the first sandbox) imports litellm and the agent's other
libraries, then forks for each agent start. The sandbox's `mini-swe-agent` is a small launcher: it hands this
process its argv, environment and stdio over a Unix socket and waits. The fork joins the launcher's own mount and pid
namespaces, root, working directory, credentials and umask (read from /proc by the pid the kernel reports for the
socket's peer, so a trial can only ever start an agent inside itself), then runs the real console script, unchanged,
with the launcher's argv. Its exit status (or signal) becomes the launcher's.

What makes a warm start the same as a cold one:
- mini-swe-agent itself is never imported here: its import prints a banner, creates its config dir and loads a .env
  from the trial's $HOME, so it runs in the fork, inside the trial. Only third-party libraries are warmed.
- Every environment variable those imports read is recorded with the value seen; a start whose environment
  differs in any of them, or whose trial holds a .env where litellm's import looks for one (every directory above
  its package), or whose stdio differs in being a terminal, starts cold instead: the fork execs the real script.
- The fork replaces the environment, stdio (0, 1, 2), sys.argv, sys.path[0] and __main__ as the interpreter would
  have set them, and forgets tempfile's cached directory (the trial's own /tmp is found again).
- It sits in the trial's pid namespace, so `stop()` (which ends that namespace) kills it and all it started. A
  launcher killed on its own (an exec's timeout kills its process group) takes the agent's process group with it.
- The launcher falls back to a cold start if this process is gone.
What differs, knowingly: the warm heap is frozen out of the garbage collector (gc.freeze: else each agent's
collections and its exit walk and copy the whole heap, ~1.4 CPU-s an agent), so garbage the agent makes of imported
objects is never collected; `ps` shows the agent's name but this process's command line; environment reads by C code
during the imports are not recorded (none of the rig's agent variables is one).

    python agent_zygote.py SOCKET_NAME LIFETIME_FD SCRIPT...   (SCRIPT: the console scripts it may start)
"""

from __future__ import annotations

import gc
import marshal
import os
import select
import signal
import socket
import struct
import sys
import types

# What mini-swe-agent imports besides itself, litellm being nearly all of the cost: at start-up, then (measured on
# the rig's rollouts) during its first model call.
WARM = ("litellm", "typer", "rich.console", "jinja2", "yaml", "platformdirs", "dotenv", "tenacity", "pydantic",
        "litellm.proxy._types", "litellm.llms.litellm_proxy.chat.transformation",
        "litellm.llms.openai.chat.gpt_audio_transformation", "litellm.llms.github_copilot.authenticator",
        "litellm.integrations.generic_api.generic_api_callback", "litellm.integrations.prometheus_services",
        "prompt_toolkit", "httpcore", "h11", "h2.connection", "xml.dom.minidom", "rich.logging", "rich.status")

# The launcher, as the sandbox's image ships it. `-IS`: it imports nothing of the venv's and reads no PYTHON*
# variable, so it costs milliseconds. It never runs the agent itself, except cold when the warm process is gone.
LAUNCHER = r'''#!{python} -IS
import marshal, os, signal, socket, struct, sys
SOCKET, SCRIPT = {socket!r}, {script!r}
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    conn.connect("\0" + SOCKET)
except OSError as exc:
    print(f"rig: warm agent start unavailable ({{exc}}); starting cold", file=sys.stderr, flush=True)
    os.execv(SCRIPT, [SCRIPT, *sys.argv[1:]])
payload = marshal.dumps((SCRIPT, sys.argv, dict(os.environb)))
socket.send_fds(conn, [struct.pack("!I", len(payload))], [0, 1, 2])
conn.sendall(payload)
for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(number, lambda n, _: conn.send(bytes([n])))
reply = b""
while len(reply) < 4:
    chunk = conn.recv(4 - len(reply))
    if not chunk:
        sys.exit("rig: the warm agent start ended without a status")
    reply += chunk
status = struct.unpack("!i", reply)[0]
if os.WIFSIGNALED(status):
    signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
os._exit(os.waitstatus_to_exitcode(status))
'''


class _RecordingEnviron(type(os.environ)):
    """os.environ, noting every name read (and whether it was listed whole) while the warm imports run."""

    def __init__(self, environ, seen: dict, listed: list):
        super().__init__(environ._data, environ.encodekey, environ.decodekey, environ.encodevalue,
                         environ.decodevalue)
        self._seen, self._listed = seen, listed

    def __getitem__(self, key):
        try:
            value = super().__getitem__(key)
        except KeyError:
            self._seen.setdefault(key, None)
            raise
        self._seen.setdefault(key, value)
        return value

    def __contains__(self, key):
        self._seen.setdefault(key, super().get(key))
        return super().__contains__(key)

    def __iter__(self):
        self._listed.append(True)
        return super().__iter__()


def _warm() -> tuple[dict, bool, list[str]]:
    seen: dict[str, str | None] = {}
    listed: list[bool] = []
    plain = os.environ
    os.environ = _RecordingEnviron(plain, seen, listed)  # os.getenv reads the module global too
    try:
        for name in WARM:
            __import__(name)
    finally:
        os.environ = plain
    litellm = sys.modules["litellm"]
    # python-dotenv's load_dotenv(), as litellm calls it at import, walks up from the calling file's directory.
    here, dotenv_dirs = os.path.dirname(os.path.abspath(litellm.__file__)), []
    while True:
        dotenv_dirs.append(here)
        if os.path.dirname(here) == here:
            break
        here = os.path.dirname(here)
    return dict(seen), bool(listed), dotenv_dirs


def _dotenv_files(dirs: list[str]) -> list[str]:
    return [d for d in dirs if os.path.isfile(os.path.join(d, ".env"))]


def _peer_status(pid: int) -> dict[str, list[str]]:
    with open(f"/proc/{pid}/status") as f:
        return {k: v.split() for k, _, v in (line.partition(":") for line in f)}


def _receive(conn: socket.socket) -> tuple[str, list[str], dict[bytes, bytes], list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    if len(head) != 4 or len(fds) != 3:
        raise OSError("malformed request")
    size, payload = struct.unpack("!I", head)[0], b""
    while len(payload) < size:
        chunk = conn.recv(size - len(payload))
        if not chunk:
            raise OSError("request cut short")
        payload += chunk
    script, argv, env = marshal.loads(payload)
    return script, argv, env, fds


def _start(conn: socket.socket, scripts: set[str], seen: dict, listed: bool, dotenv_dirs: list[str],
           host_dotenv: list[str], ttys: tuple[bool, ...]) -> tuple[str, list[str]] | None:
    """In the per-request fork: start the agent in the peer's sandbox. Returns (script, argv) in the agent process
    (warm); the forked relay never returns."""
    pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
    script, argv, env, fds = _receive(conn)
    if script not in scripts:
        raise OSError(f"not a pre-installed agent: {script}")
    status = _peer_status(pid)
    uid, gid = int(status["Uid"][0]), int(status["Gid"][0])
    groups, umask = [int(g) for g in status.get("Groups", [])], int(status["Umask"][0], 8)
    opened = {name: os.open(f"/proc/{pid}/{name}", os.O_RDONLY) for name in ("ns/mnt", "ns/pid", "root", "cwd")}
    text_env = {k.decode(errors="surrogateescape"): v.decode(errors="surrogateescape") for k, v in env.items()}
    # The interpreter reads these itself at start-up (sys.path, stdio, locale), where no recording sees them.
    startup = {k for k in (*text_env, *os.environ) if k.startswith(("PYTHON", "LC_")) or k in ("LANG", "LANGUAGE")}
    cold = sorted({k for k, v in seen.items() if text_env.get(k) != v}
                  | {k for k in startup if text_env.get(k) != os.environ.get(k)})
    if listed or host_dotenv:
        cold.append("the warm imports' own environment")
    os.setns(opened["ns/pid"], os.CLONE_NEWPID)  # for the child only: this relay stays where it is
    agent = os.fork()
    if agent == 0:
        os.setsid()  # its own process group, which the relay kills if the launcher dies
        # The name `ps` shows, as exec'ing the script would set it (the full command line stays this process's).
        with open("/proc/self/comm", "w") as f:
            f.write(os.path.basename(argv[0])[:15])
        os.setns(opened["ns/mnt"], os.CLONE_NEWNS)
        os.fchdir(opened["root"])
        os.chroot(".")
        os.fchdir(opened["cwd"])
        os.setgroups(groups)
        os.setgid(gid)
        os.setuid(uid)
        os.umask(umask)
        log = os.dup(2)  # this server's log, for why a start went cold: the agent's own output stays its own
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        conn.close()
        os.closerange(3, log)
        os.closerange(log + 1, os.sysconf("SC_OPEN_MAX"))
        os.environ.clear()
        os.environb.update(env)
        cold += [os.path.join(d, ".env") for d in _dotenv_files(dotenv_dirs)]
        if tuple(os.isatty(fd) for fd in (0, 1, 2)) != ttys:
            cold.append("stdio on a terminal")
        if cold:
            os.write(log, f"rig: agent started cold, unlike the warm imports in: {', '.join(cold)}\n".encode())
            os.close(log)
            os.execv(script, [script, *argv[1:]])
        os.close(log)
        return script, argv
    for fd in (*fds, *opened.values()):
        os.close(fd)
    done = os.pidfd_open(agent)
    while True:
        ready, _, _ = select.select([conn, done], [], [])
        if done in ready:
            status = os.waitpid(agent, 0)[1]
            try:
                conn.sendall(struct.pack("!i", status))
            except OSError:
                pass
            os._exit(0)
        data = conn.recv(64)
        if not data:  # the launcher is gone (killed with its exec's process group): so is what it started
            try:
                os.killpg(agent, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(agent, 0)
            os._exit(0)
        for number in data:
            try:
                os.killpg(agent, number)
            except ProcessLookupError:
                pass


def serve(name: str, lifetime: int, scripts: set[str]) -> tuple[str, list[str]]:
    """Answer launchers until the sandbox's server closes `lifetime`; returns only in a warm-started agent."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(64)  # launchers that connect during the imports wait in the backlog
    seen, listed, dotenv_dirs = _warm()
    host_dotenv = _dotenv_files(dotenv_dirs)
    if listed or host_dotenv:
        print(f"rig: agent starts stay cold (environment listed: {listed}; .env found: {host_dotenv})",
              file=sys.stderr, flush=True)
    ttys = tuple(os.isatty(fd) for fd in (0, 1, 2))
    # Out of the collector's sight (see the docstring). Garbage of the imports is collected first; what stays is live.
    gc.collect()
    gc.freeze()

    def reap(*_):
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    return
            except ChildProcessError:
                return

    signal.signal(signal.SIGCHLD, reap)
    while True:
        ready, _, _ = select.select([listener, lifetime], [], [])
        if lifetime in ready:
            sys.exit(0)
        conn, _ = listener.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            listener.close()
            os.close(lifetime)
            try:
                started = _start(conn, scripts, seen, listed, dotenv_dirs, host_dotenv, ttys)
            except Exception as exc:  # noqa: BLE001 - one bad request must not end the server
                print(f"rig: warm agent start failed: {exc}", file=sys.stderr, flush=True)
                os._exit(1)
            return started
        conn.close()


def run_script(script: str, argv: list[str]) -> None:
    """Run a console script as `python SCRIPT ARGS` would: its own __main__, argv, and its directory on sys.path."""
    sys.argv[:] = argv
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        stream.reconfigure(line_buffering=stream is sys.stderr or os.isatty(fd))
    import importlib.machinery
    import tempfile

    tempfile.tempdir = None  # cached by the imports; the trial's own is found again on first use
    with open(script, "rb") as f:
        code = compile(f.read(), argv[0], "exec", dont_inherit=True)  # not this file's __future__ imports
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__, main.__cached__ = argv[0], __builtins__, None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", argv[0])
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


if __name__ == "__main__":
    run_script(*serve(sys.argv[1], int(sys.argv[2]), set(sys.argv[3:])))
