"""Run the real `openenv harbor serve` with the rig's `local` sandbox registered in-process.

    /tmp/v312/bin/python tests/rig/harbor_server.py --dataset tests/rig/tasks \
        --llm-url http://127.0.0.1:8001 --host 127.0.0.1 --port 8000 --capture-port 8100 --expose direct

Every argument goes to `openenv harbor serve` unchanged; this file only adds a few things first (and, for restart
tests, can wait for the port: `serve_when_port_free`).

1. `sandbox="local"` (and `local-down`, the same with its backend down). Harbor's `EnvironmentConfig.type` is a closed enum, but it takes any
   environment by `import_path`, and OpenEnv already uses exactly that escape hatch for its E2B
   streaming variant. So `build_trial_config` is wrapped to turn `local` into
   `import_path=local_sandbox:LocalSandbox`, and the capabilities report is taught the name so
   clients see it listed as usable.
2. The mini-swe-agent install step is skipped when the sandbox already has the agent. Harbor's
   `install()` fetches uv and a Python from GitHub, which this machine cannot reach; the run command
   itself stays Harbor's own.
3. A second harness name, `mini-swe-agent-twin`: mini-swe-agent again, under its own seam. Every other
   harness installs itself from the network, which this machine cannot reach; rotating between two names
   is what the tests need, and the twin runs the real agent with the real wiring.

4. With RIG_TUNNEL_DIR set, `--expose gradio` opens the rig's tunnel stand-in (tunnel.py, its pid in
   RIG_TUNNEL_DIR/tunnel.pid) instead of gradio's, which needs the internet: the sandbox is handed its URL.
5. With RIG_E2B_STANDIN set, `sandbox="e2b"` runs in the local sandbox (e2b needs the internet), so a run takes
   every path the script takes for e2b.
6. `sandbox="local-refused"`: a backend whose plan refuses every sandbox with the e2b SDK's own exception, as
   RIG_SANDBOX_REFUSAL says (`concurrency` or `lifetime`; local_sandbox.RefusedSandbox).

Session slots: OpenEnv sizes them from `MAX_CONCURRENT_ENVS` (default 4), one per connected client.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from openenv.core.harness.capture.forwarding import PortForwarder

RIG_DIR = Path(__file__).resolve().parent
# Sandbox name -> Harbor environment class. `local-down` is the same sandbox with its backend down.
SANDBOXES = {"local": "local_sandbox:LocalSandbox", "local-down": "local_sandbox:UnreachableSandbox",
             "local-refused": "local_sandbox:RefusedSandbox"}
if os.environ.get("RIG_E2B_STANDIN"):  # e2b needs the internet: its rollouts run in the local sandbox instead
    SANDBOXES["e2b"] = SANDBOXES["local"]

# Identical to the PATH prelude of Harbor's own mini-swe-agent run command, so "present" means
# "the run command will find it".
_AGENT_ON_PATH = (
    'if [ -f "$HOME/.local/bin/env" ]; then . "$HOME/.local/bin/env"; '
    'else export PATH="$HOME/.local/bin:$PATH"; fi; command -v mini-swe-agent'
)


def register_local_sandbox() -> None:
    from openenv.harbor import capabilities, rollout

    # Harbor resolves `import_path` with importlib in this process, so the rig dir must be importable.
    if str(RIG_DIR) not in sys.path:
        sys.path.insert(0, str(RIG_DIR))

    build = rollout.build_trial_config

    def build_trial_config(*, sandbox: str, **kwargs):
        if sandbox not in SANDBOXES:
            return build(sandbox=sandbox, **kwargs)
        config = build(sandbox=None, **kwargs)
        config.environment.import_path = SANDBOXES[sandbox]
        return config

    rollout.build_trial_config = build_trial_config

    check = capabilities.check_sandbox

    def check_sandbox(name: str) -> capabilities.SandboxStatus:
        if name not in SANDBOXES:
            return check(name)
        from local_sandbox import LocalSandbox

        try:
            LocalSandbox.preflight()
        except SystemExit as exc:  # Harbor's preflight convention, as check_sandbox expects
            return capabilities.SandboxStatus(name, False, str(exc))
        return capabilities.SandboxStatus(name, True, "rig: namespaced local processes")

    capabilities.check_sandbox = check_sandbox
    # `capabilities()` binds its default sandbox tuple at definition time, so the default itself
    # has to change; every caller (startup report, MCP tool, UI) goes through it.
    listed = capabilities.capabilities.__kwdefaults__["sandboxes"]
    capabilities.capabilities.__kwdefaults__["sandboxes"] = (*listed, *(n for n in SANDBOXES if n not in listed))


def skip_preinstalled_agent_install() -> None:
    from harbor.agents.installed.mini_swe_agent import MiniSweAgent

    install = MiniSweAgent.install

    async def install_unless_present(self, environment) -> None:
        probe = await environment.exec(_AGENT_ON_PATH)
        if probe.return_code != 0:
            await install(self, environment)

    MiniSweAgent.install = install_unless_present


TWIN_HARNESS = "mini-swe-agent-twin"


def register_twin_harness() -> None:
    from dataclasses import replace

    from openenv.harbor import seams

    # Harbor builds an agent from `import_path` when set, so the twin needs no name in Harbor's own registry.
    seams.SEAMS[TWIN_HARNESS] = replace(seams.SEAMS["mini-swe-agent"], name=TWIN_HARNESS,
                                        import_path="harbor.agents.installed.mini_swe_agent:MiniSweAgent")


class RigTunnel(PortForwarder):
    """openenv's forwarder for gradio, played by tunnel.py: the URL it returns is the tunnel's own port."""

    def start(self, local_port: int, *, local_host: str = "127.0.0.1") -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pid_file = Path(os.environ["RIG_TUNNEL_DIR"]) / "tunnel.pid"
        pid_file.unlink(missing_ok=True)
        self._proc = subprocess.Popen([sys.executable, str(RIG_DIR / "tunnel.py"), str(port), str(local_port),
                                       str(pid_file)], start_new_session=True)
        while not pid_file.exists() or not pid_file.read_text():  # written once it listens
            if self._proc.poll() is not None:
                raise RuntimeError("rig tunnel exited at start")
            time.sleep(0.05)
        self._url = f"http://127.0.0.1:{port}"
        return self._url

    def stop(self) -> None:
        if getattr(self, "_proc", None) is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def register_tunnel_standin() -> None:
    if os.environ.get("RIG_TUNNEL_DIR"):
        from openenv.core.harness.capture import forwarding

        forwarding._FORWARDERS["gradio"] = RigTunnel


def import_ahead() -> None:
    """Import what a start spends most of its time on, before what the server waits for is there."""
    import importlib

    from openenv.harbor import capabilities

    capabilities.capabilities()  # imports every sandbox backend's SDK: most of a start
    for module in ("uvicorn", "gradio", "openenv.harbor.serving", "openenv.harbor.environment", "openenv.harbor.ui",
                   "openenv.core.env_server.web_interface", "openenv.core.harness.capture.forwarding"):
        importlib.import_module(module)


def serve_when_port_free() -> None:
    """RIG_SERVE_WHEN_PORT_FREE=1: a successor for a restart test. Imported ahead, it waits until the server it
    replaces is gone from the port, so the restart takes seconds on a loaded machine instead of the better part of a
    minute."""
    port, parent = int(sys.argv[sys.argv.index("--port") + 1]), os.getppid()
    print(f"rig: imported; waiting for port {port} to be free", flush=True)
    while os.getppid() == parent:  # a test that died never frees the port: leave with it
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            try:
                s.bind(("127.0.0.1", port))
                return
            except OSError:
                time.sleep(0.1)
    sys.exit(1)


def serve_when_engine_answers() -> None:
    """RIG_WAIT_FOR_ENGINE=1: started beside the rig's engine, not after it. `openenv harbor serve` probes --llm-url
    once as it starts, so this imports first, then waits until the engine answers its health check."""
    import urllib.request

    health = sys.argv[sys.argv.index("--llm-url") + 1].removesuffix("/v1") + "/health"
    parent = os.getppid()
    while os.getppid() == parent:  # a test that died never starts the engine: leave with it
        try:
            with urllib.request.urlopen(health, timeout=5):
                return
        except OSError:
            time.sleep(0.2)
    sys.exit(1)


def main() -> None:
    # Offline machine: otherwise Harbor's litellm import spends ~7 s retrying GitHub for a cost map.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    register_local_sandbox()
    skip_preinstalled_agent_install()
    register_twin_harness()
    register_tunnel_standin()
    if os.environ.get("RIG_SERVE_WHEN_PORT_FREE") or os.environ.get("RIG_WAIT_FOR_ENGINE"):
        import_ahead()
    if os.environ.get("RIG_SERVE_WHEN_PORT_FREE"):
        serve_when_port_free()
    if os.environ.get("RIG_WAIT_FOR_ENGINE"):
        serve_when_engine_answers()
    from openenv.cli.__main__ import main as openenv_main

    sys.argv = ["openenv", "harbor", "serve", *sys.argv[1:]]
    openenv_main()


if __name__ == "__main__":
    main()
