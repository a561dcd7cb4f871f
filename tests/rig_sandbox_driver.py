"""Drives two of the rig's sandboxes (tests/rig/local_sandbox.py) from the server's Python, for test_rig_sandbox.py.

    $AGH_SERVER_PYTHON tests/rig_sandbox_driver.py WORKDIR   -> one JSON object on stdout
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path

RIG = Path(__file__).resolve().parent / "rig"
sys.path.insert(0, str(RIG))

import local_sandbox  # noqa: E402
from harbor.models.task.config import EnvironmentConfig  # noqa: E402
from harbor.models.trial.paths import TrialPaths  # noqa: E402

ON_PATH = 'export PATH="$HOME/.local/bin:$PATH"; '


def in_namespace(box: local_sandbox.LocalSandbox) -> dict[int, str]:
    """pid -> command line of every live process in the sandbox's pid namespace, init's shell left out."""
    ns, found = os.readlink(f"/proc/{box._init_pid}/ns/pid"), {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if int(entry) != box._init_pid and state != "Z" and os.readlink(f"/proc/{entry}/ns/pid") == ns:
                found[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return found


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


async def until(condition, what: str, seconds: float = 300.0):
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.2)
    return value


async def main(work: Path) -> dict:
    boxes = {}
    for name in ("a", "b"):
        paths = TrialPaths(work / name)
        paths.mkdir()
        boxes[name] = local_sandbox.LocalSandbox(
            environment_dir=RIG / "tasks/coin/environment", environment_name="coin", session_id=f"rig-{name}",
            trial_paths=paths, task_env_config=EnvironmentConfig())
        await boxes[name].start(force_build=False)
    a, b = boxes["a"], boxes["b"]
    report: dict = {}
    # The same command run warm (the image's launcher) and cold (the console script itself), in the same sandbox.
    real = local_sandbox.AGENT_VENV / "bin" / "mini-swe-agent"
    env = {"MSWEA_GLOBAL_CONFIG_DIR": "/tmp/config-a", "MSWEA_CONFIGURED": "true"}
    for args in ("--bogus", "--help"):
        warm = await a.exec(ON_PATH + f"mini-swe-agent {args}", env=env)
        cold = await a.exec(f"{real} {args}", env=env)
        report[args] = [[r.return_code, r.stdout, r.stderr] for r in (warm, cold)]
    report["config dir"] = {"a": (a._root / "tmp/config-a").is_dir(), "b": (b._root / "tmp/config-a").is_dir(),
                            "host": Path("/tmp/config-a").is_dir()}
    # An agent whose model never answers: it runs until its exec is cancelled, or the sandbox stops.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    run = (ON_PATH + "OPENAI_API_KEY=x mini-swe-agent --yolo --model=openai/x --task=t -c mini "
           f"-c model.model_kwargs.api_base=http://127.0.0.1:{silent.getsockname()[1]}/v1 --exit-immediately "
           "--cost-limit 0 2>&1 </dev/null | tee /logs/agent/mini-swe-agent.txt")

    def agent() -> int | None:
        return next((pid for pid, cmd in in_namespace(a).items() if "agent_zygote.py" in cmd or " --yolo " in cmd
                     and "-IS" not in cmd and "bash" not in cmd), None)

    for ending in ("cancelled", "stopped"):
        task = asyncio.create_task(a.exec(run, env={"MSWEA_CONFIGURED": "true"}))
        pid = await until(agent, f"no agent in the sandbox ({ending})")
        relay = parent(pid)
        forked_from = Path(f"/proc/{parent(relay)}/cmdline").read_bytes().split(b"\0")
        report[ending] = {"forked from": os.path.basename(forked_from[1].decode()) if len(forked_from) > 1 else "",
                          "b sees it": pid in in_namespace(b)}
        if ending == "cancelled":
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        else:
            await a.stop(delete=False)
            await asyncio.gather(task, return_exceptions=True)
        await until(lambda: not os.path.exists(f"/proc/{pid}") or
                    Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z",
                    f"the agent outlived its {ending} exec")
        report[ending]["left"] = in_namespace(a) if ending == "cancelled" else {}
    await b.stop(delete=True)
    return report


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(Path(sys.argv[1]))), default=str))
