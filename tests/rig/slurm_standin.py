"""Stand-ins for what a SLURM job runs but this machine cannot: `srun`, `scontrol`, `uv`, `vllm`, `accelerate` and the
trainer (`python <script>`). Invoked as `slurm_standin.py <program> <args...>` by one-line shims named after the
program, so the wrappers find them on PATH.

Every invocation appends {"prog", "argv", "env", "pid"} to the JSON-lines file $STANDIN_LOG. Launchers behave like
the real ones as far as the wrappers can tell: `srun` and `uv run` run their command in place (exec, so a signal sent
to them reaches it), `vllm serve` answers GET /health on its --port until SIGTERM ($STANDIN_VLLM: `serve`, `load`
never answers, `crash` exits 1 at once), `scontrol` expands a comma node list. The trainer follows $STANDIN_TRAINER: `finish` exits 0, `crash` exits 1, `wait` runs until SIGTERM or
SIGUSR1, then exits 75 as the script does after its checkpoint; run by `accelerate` it exits 1 instead, the code
torchrun reports when its ranks exited non-zero.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import sys
import threading
import time


def record(prog: str, argv: list[str], **extra) -> None:
    entry = {"prog": prog, "argv": argv, "env": dict(os.environ), "pid": os.getpid(), **extra}
    with open(os.environ["STANDIN_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\n")


def srun(argv: list[str]) -> None:
    command = list(argv)
    while command and command[0].startswith("--"):
        command.pop(0)
    os.execvp(command[0], command)


def scontrol(argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"]:
        print("\n".join(argv[2].split(",")))
    return 0


def uv(argv: list[str]) -> None:
    assert argv[0] == "run" and "--" in argv, argv
    command = argv[argv.index("--") + 1:]
    os.execvp(command[0], command)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def vllm(argv: list[str]) -> int:
    mode = os.environ.get("STANDIN_VLLM", "serve")
    if mode == "crash":
        return 1
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    record("vllm", argv, event="up")
    if "--headless" not in argv and mode == "serve":
        server = http.server.ThreadingHTTPServer(("0.0.0.0", int(argv[argv.index("--port") + 1])), Health)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    while not stopped.wait(0.2):
        pass
    record("vllm", argv, event="stopped")
    return 0


def trainer(prog: str, argv: list[str], rc_after_signal: int) -> int:
    mode = os.environ.get("STANDIN_TRAINER", "finish")
    if mode == "finish":
        return 0
    if mode == "crash":
        return 1
    got: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, _frame: got.append(signum))
    record(prog, argv, event="running")
    while not got:
        time.sleep(0.1)
    record(prog, argv, event="signalled", signal=signal.Signals(got[0]).name)
    return rc_after_signal


def main() -> int:
    prog, argv = sys.argv[1], sys.argv[2:]
    record(prog, argv)
    if prog == "srun":
        srun(argv)
    if prog == "scontrol":
        return scontrol(argv)
    if prog == "uv":
        uv(argv)
    if prog == "vllm":
        return vllm(argv)
    if prog == "accelerate":
        return trainer(prog, argv, rc_after_signal=1)
    if prog == "python":
        return trainer(prog, argv, rc_after_signal=75)
    raise SystemExit(f"no stand-in for {prog}")


if __name__ == "__main__":
    sys.exit(main())
