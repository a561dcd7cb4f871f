"""Does the script's rollout path cost anything over the Harbor server itself? (issue 6)

On the CPU rig (the real `openenv harbor serve` + capture proxy + mini-swe-agent; stand-in engine and sandbox), side
by side in one run:

1. throughput at concurrency N: rollouts/min through the script's `HarborSessionFactory` driven by TRL's
   `HarnessRolloutWorker` (built as `build_trainer` builds it), against N threads calling `HarborEnv.run_rollout`
   on the same server. Each repetition measures both, in alternating order; the rate is taken between the end of
   the first wave of N rollouts and the last counted completion, so start-up (the worker child's imports) is out.
2. shutdown: last optimizer step -> `train()` returned, in a real run of the script.
3. startup: process start -> first session dispatched, minus model load (`build_trainer`), same run.
4. the factory's own per-rollout work (client construction, session create/close over HTTP, result parse, trace
   conversion), timed on a real rollout result, as a fraction of the rollout's wall time.
5. the command line: `--help`, a refused value, a mistyped flag and a malformed TRL field (which TrlParser, so TRL,
   must read), wall seconds, median of 5 each (no rig needed).

With py-spy (bench/run.sh provides it): a profile of the worker's stop, and of the server and the rollout child
during one factory window at the highest N. Ends with `perf: ratio_min=<x> shutdown_s=<y> startup_s=<z> help_s=<h>
refusal_s=<r>`.
Run: `bash bench/run.sh [--reps 3] [--sections cli,script,stop,overhead,throughput,profile] [--json FILE]`.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import queue
import re
import statistics
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from conftest import RIG, Rig, script_env  # noqa: E402

if os.environ.get("AGH_CPU_RIG") != "1":  # the worker needs the rig's CPU stand-ins, in this process and its child
    os.execve(sys.executable, [sys.executable, *sys.argv], script_env())

import async_grpo_harbor as script  # noqa: E402

TASK = "echo-hello"  # solved by the stand-in engine's policy every time, so every rollout is the same work
STEP_LIMIT, AGENT_TIMEOUT = 6, 60.0
TEMPERATURE = 1.0


def cpu_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, to show whether a window was CPU-bound."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


class Window:
    """Completion instants of one measurement; rate over completions first_wave..last."""

    def __init__(self, n: int, count: int):
        self.n, self.count = n, count
        self.stamps: list[float] = []
        self.latencies: list[float] = []
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.cpu0 = self.cpu1 = (0.0, 0.0)

    def add(self, latency: float | None = None) -> None:
        with self.lock:
            if len(self.stamps) >= self.count:
                return
            self.stamps.append(time.time())
            if latency is not None:
                self.latencies.append(latency)
            if len(self.stamps) == self.n:
                self.cpu0 = cpu_busy()
            if len(self.stamps) >= self.count:
                self.cpu1 = cpu_busy()
                self.done.set()

    def per_min(self) -> float:
        s = self.stamps
        return 60.0 * (len(s) - self.n) / (s[-1] - s[self.n - 1])

    def cpu_util(self) -> float:
        """Fraction of all cores busy during the measured part."""
        busy, total = (b - a for a, b in zip(self.cpu0, self.cpu1))
        return busy / total if total else float("nan")


def rollout_spec(rig: Rig, task_index: int) -> dict:
    from openenv.core.harness.capture.upstream import training_sampling

    # Exactly what the factory sends: TRL hands it this policy.
    sampling = training_sampling({"temperature": TEMPERATURE, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0})
    return dict(split=rig.split, task_index=task_index, harness="mini-swe-agent", sandbox="local",
                reward_key="correct,reward", agent_timeout_sec=AGENT_TIMEOUT, agent_step_limit=STEP_LIMIT,
                sampling=sampling)


def wait_server_idle(rig: Rig, timeout: float = 180.0) -> None:
    """The Harbor server has no cancel: rollouts abandoned at a stop run on; wait until every sandbox is gone."""
    boxes = rig.workdir / "sandboxes"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not boxes.exists() or not any(boxes.iterdir()):
            time.sleep(0.5)
            if not boxes.exists() or not any(boxes.iterdir()):
                return
        time.sleep(0.2)
    raise RuntimeError("the Harbor server did not go idle")


def direct(rig: Rig, spec: dict, n: int, count: int) -> Window:
    """N threads, each with its own `HarborEnv`, calling `run_rollout` back to back."""
    from openenv.harbor.client import HarborEnv

    w, errors = Window(n, count), []

    def loop():
        client = HarborEnv(base_url=rig.harbor_url)
        try:
            while not w.done.is_set():
                t0 = time.monotonic()
                r = client.run_rollout(**spec)
                if not (r.ok and r.reward is not None):
                    errors.append(r.error)
                w.add(time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))
            w.done.set()
        finally:
            # HarborEnv.close() waits ~10 s on the websocket handshake; it holds no rollout, so not on the clock.
            threading.Thread(target=client.close, daemon=True).start()

    threads = [threading.Thread(target=loop) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors or len(w.stamps) < count:
        raise RuntimeError(f"direct rollouts failed: {errors[:3]}")
    return w


def make_worker(rig: Rig, model_dir: Path, tasks: list, n: int):
    """TRL's HarnessRolloutWorker with the script's factory, reward and stop, built with build_trainer's arguments."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo.openenv_harness import HarnessRolloutWorker

    class Worker(HarnessRolloutWorker):
        _loop_cls = script.HarborRolloutLoop
        stop = script.stop_rollout_worker
        samples_left_at_stop = 0

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    request_timeout = int(script.rollout_budget_s(AGENT_TIMEOUT))
    return Worker(
        model_name=str(model_dir), reward_funcs=[],
        dataset=Dataset.from_list(script.task_rows(tasks, rig.split, ["mini-swe-agent"])),
        processing_class=tokenizer, eos_token_ids=[tokenizer.eos_token_id], num_generations=min(n, 2),
        max_inflight_tasks=n, queue_maxsize=1024, vllm_server_url=rig.engine_url, max_tokens=4096,
        temperature=TEMPERATURE, request_timeout=request_timeout,
        harness_session_factory=functools.partial(
            script.HarborSessionFactory, harbor_url=rig.harbor_url, harness="mini-swe-agent", sandbox="local",
            reward_key="correct,reward", agent_step_limit=STEP_LIMIT, agent_timeout_s=AGENT_TIMEOUT,
            max_consecutive_failures=32),
        rollout_reward_fn=functools.partial(script.harbor_reward, step_limit=STEP_LIMIT), efficiency_weight=0.1,
        max_zero_variance_groups=0,  # echo-hello is always solved: every group would be kept out, and the run stopped
    )


def through_factory(rig: Rig, model_dir: Path, tasks: list, n: int, count: int, on_started=None) -> Window:
    """Counts rollouts the worker finished (one `rollout/duration_s` metric each) while draining its sample queue
    as the trainer would, so back-pressure never throttles it."""
    from accelerate.state import PartialState

    PartialState()  # TRL's worker logs through accelerate, which the trainer has initialised by then
    w = Window(n, count)
    worker = make_worker(rig, model_dir, tasks, n)
    worker.start()
    if on_started:
        on_started(worker)
    try:
        deadline = time.monotonic() + 60 + count * 60
        while not w.done.is_set():
            if time.monotonic() > deadline:
                raise RuntimeError("the rollout worker stalled")
            worker.check_health(stale_after_s=deadline - time.monotonic() + 60)  # raises once the child failed
            try:
                while True:
                    worker.rollout_buffer.get_nowait()
            except queue.Empty:
                pass
            try:
                item = worker.metrics_queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if "rollout/duration_s" in item:
                w.add(item["rollout/duration_s"])
    finally:
        worker.stop()
    return w


def measure_throughput(rig, model_dir, tasks, spec, levels, reps, waves, profile) -> dict:
    results = {}
    for n in levels:
        count = n + max(n * waves, 4)  # the first wave of n is start-up; at least 4 rollouts are timed
        rows = []
        for rep in range(reps):
            order = ("direct", "factory") if rep % 2 == 0 else ("factory", "direct")
            row = {}
            for path in order:
                wait_server_idle(rig)
                started = None
                if profile and path == "factory" and n == max(levels) and rep == 0:
                    started = functools.partial(start_profiles, rig, profile)
                w = (direct(rig, spec, n, count) if path == "direct"
                     else through_factory(rig, model_dir, tasks, n, count, started))
                row[path] = {"per_min": w.per_min(), "cpu": w.cpu_util(),
                             "latency_median_s": statistics.median(w.latencies)}
                print(f"  N={n} rep={rep} {path:8s} {w.per_min():6.2f} rollouts/min  cpu {w.cpu_util():.0%}  "
                      f"rollout latency median {statistics.median(w.latencies):.2f}s", flush=True)
            row["ratio"] = row["factory"]["per_min"] / row["direct"]["per_min"]
            rows.append(row)
        results[n] = {
            "reps": rows,
            "direct_per_min": statistics.median(r["direct"]["per_min"] for r in rows),
            "factory_per_min": statistics.median(r["factory"]["per_min"] for r in rows),
            "ratio": statistics.median(r["ratio"] for r in rows),
            "cpu_direct": statistics.median(r["direct"]["cpu"] for r in rows),
            "cpu_factory": statistics.median(r["factory"]["cpu"] for r in rows),
            "latency_direct_s": statistics.median(r["direct"]["latency_median_s"] for r in rows),
            "latency_factory_s": statistics.median(r["factory"]["latency_median_s"] for r in rows),
        }
        wait_server_idle(rig)
    return results


# ---- profile of the slowest path: py-spy on the Harbor server and on TRL's rollout child
def start_profiles(rig: Rig, profile: dict, worker) -> None:
    py_spy, seconds, out = profile["py_spy"], profile["seconds"], profile["dir"]
    out.mkdir(parents=True, exist_ok=True)
    targets = {"harbor_server": rig.harbor.proc.pid, "rollout_child": worker._process.pid}
    for name, pid in targets.items():
        profile.setdefault("procs", []).append((name, subprocess.Popen(
            [py_spy, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "50", "--format", "raw",
             "--idle", "--threads", "--nonblocking", "--output", str(out / f"{name}.txt")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)))


def summarise_profile(path: Path, top: int = 12) -> list[tuple[str, float]]:
    """Share of samples per leaf function (self time), plus idle share, from py-spy's collapsed stacks."""
    counts: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        leaf = stack.split(";")[-1]
        leaf = re.sub(r" \((/[^)]*/)?([^/)]+)\)", r" (\2)", leaf)
        counts[leaf] = counts.get(leaf, 0) + int(n)
        total += int(n)
    return [(k, v / total) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:top]]


def profile_stop(rig: Rig, model_dir: Path, tasks: list, py_spy: str, out: Path, n: int = 4) -> dict:
    """Where the ~2 s of the script's worker stop go: py-spy on TRL's rollout child from the stop to its exit."""
    from accelerate.state import PartialState

    PartialState()
    worker = make_worker(rig, model_dir, tasks, n)
    worker.start()
    done = 0
    while done < n:
        item = worker.metrics_queue.get(timeout=120)
        done += "rollout/duration_s" in item
    out.mkdir(parents=True, exist_ok=True)
    path = out / "rollout_child_stop.txt"
    spy = subprocess.Popen([py_spy, "record", "--pid", str(worker._process.pid), "--duration", "6", "--rate", "200",
                            "--format", "raw", "--idle", "--threads", "--nonblocking", "--output", str(path)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    time.sleep(1.0)  # py-spy attached
    t0 = time.monotonic()
    worker.stop()
    stop_s = time.monotonic() - t0
    spy.wait(timeout=30)
    return {"stop_s": stop_s, "profile": summarise_profile(path, top=15) if path.exists() else []}


# ---- 4. the factory's own per-rollout work
def factory_overhead(rig: Rig, spec: dict, reps: int = 20) -> dict:
    from openenv.harbor.client import _as_text
    from openenv.harbor.contract import to_training_trace
    from openenv.harbor.models import HarborRolloutResult

    session = script.HarborServerSession(rig.harbor_url, timeout_s=600)
    try:
        arguments = {**spec, "keep_sandbox": False, "force_build": False}
        session.open()
        raw = session._call("run_rollout", **arguments)
    finally:
        session.close()
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "result": raw}).encode()
    result = HarborRolloutResult.model_validate_json(_as_text(raw))

    def timed(fn) -> float:
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples) * 1000

    def session_cycle():
        s = script.HarborServerSession(rig.harbor_url, timeout_s=30)
        s.open()
        s.close()

    def client_cycle():
        c = script.HarborServerSession(rig.harbor_url, 600)
        c.close()

    parts = {
        "client construct+close (HarborServerSession, not opened)": timed(client_cycle),
        "session create+close over HTTP (2 connects)": timed(session_cycle),
        "reply JSON decode (MCP envelope)": timed(lambda: json.loads(body)),
        "result parse (pydantic, HarborRolloutResult)": timed(lambda: HarborRolloutResult.model_validate_json(
            _as_text(json.loads(body)["result"]))),
        "trace conversion (to_training_trace)": timed(lambda: to_training_trace(result)),
    }
    return {"parts_ms": parts, "total_ms": sum(parts.values()), "reply_bytes": len(body),
            "turns": result.n_turns, "server_wall_s": result.wall_s, "phase_timings": result.phase_timings}


# ---- 5. the command line
def cli_times(reps: int = 5) -> dict:
    """`--help` and refused arguments, as a user runs them (no rig stand-ins in the environment): wall seconds,
    median of `reps`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AGH_CPU_RIG")}
    times = {}
    for name, args in (("help_s", ["--help"]), ("refusal_s", ["--num-generations", "1"]),
                       ("unknown_flag_s", ["--lerning-rate", "1e-6"]), ("trl_field_s", ["--epsilon-high", "x"]),
                       # What only TRL's own parser judges: a name outside an enum, a field the script sets.
                       ("trl_choice_s", ["--optim", "adamw_torchh"]), ("trl_decided_s", ["--logging-steps", "5"])):
        runs = []
        for _ in range(reps):
            start = time.perf_counter()
            subprocess.run([sys.executable, str(ROOT / "async_grpo_harbor.py"), *args], capture_output=True, env=env)
            runs.append(time.perf_counter() - start)
        times[name] = statistics.median(runs)
    return times


# ---- 2 + 3. a real run of the script: startup and shutdown
def script_run(rig: Rig, model_dir: Path, workdir: Path, max_steps: int, embedded: bool) -> dict:
    """One short training run. `embedded`: no --harbor-url, so the script starts the (rig's) Harbor server itself."""
    out = workdir / f"run-{time.time_ns()}"
    args = [*rig.base_args(), "--tasks", TASK + ",coin,coin2", "--num-generations", "4", "--max-inflight", "4",
            "--micro-batches-per-step", "1", "--max-staleness", "2", "--learning-rate", "1e-3",
            "--temperature", str(TEMPERATURE), "--agent-step-limit", str(STEP_LIMIT),
            "--agent-timeout", str(AGENT_TIMEOUT), "--max-steps", str(max_steps), "--save-steps", "1000",
            "--output-dir", str(out), "--run-name", "bench"]
    env = script_env()
    if embedded:
        i = args.index("--harbor-url")
        del args[i:i + 2]
        args += ["--harbor-command", f"{os.environ['AGH_SERVER_PYTHON']} {RIG / 'harbor_server.py'}"]
        env.update(RIG_SANDBOX_DIR=str(rig.workdir / "sandboxes"), OPENENV_HARBOR_TRIALS_DIR=str(out / "trials"))
    t_start = time.time()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "timed_main.py"), *args], cwd=workdir,
                          env=env, text=True, capture_output=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"script run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    found = re.findall(r"^bench-mark (\w+) ([\d.]+)$", proc.stdout, re.M)
    missing = {"main_start", "build_start", "build_end", "first_dispatch", "step_end", "train_return"} - {
        k for k, _ in found}
    if missing:
        raise RuntimeError(f"no {sorted(missing)} in the run's output:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    last = {k: float(v) for k, v in found}  # the last step_end wins
    first = {k: float(v) for k, v in reversed(found)}
    stop = re.search(r"rollout worker exited on its own in ([\d.]+)s", proc.stdout)
    model_load = last["build_end"] - last["build_start"]
    server = last["server_ready"] - last["server_start"] if "server_ready" in last else 0.0
    startup = first["first_dispatch"] - t_start - model_load
    return {
        "embedded": embedded,
        "imports_s": first["main_start"] - t_start,
        "preflight_s": last["build_start"] - first["main_start"] - server,
        "server_start_s": server,
        "model_load_s": model_load,
        "train_begin_to_dispatch_s": first["first_dispatch"] - last["build_end"],
        "startup_s": startup,
        "startup_script_s": startup - server,
        "shutdown_s": last["train_return"] - last["step_end"],
        "worker_stop_s": float(stop[1]) if stop else None,
        "steps": len(re.findall(r"^bench-mark step_end", proc.stdout, re.M)),
    }


def versions() -> dict:
    server = subprocess.run(
        [os.environ["AGH_SERVER_PYTHON"], "-c", "import importlib.metadata as m, sys; print(sys.version.split()[0], "
         "*(m.version(p) for p in ('openenv', 'harbor', 'mini-swe-agent')))"], capture_output=True, text=True)
    py312, openenv_s, harbor, mswea = server.stdout.split()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    return {"machine": f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, no GPU, {platform.platform()}",
            "trainer": f"Python {platform.python_version()}, trl {metadata.version('trl')}, transformers "
                       f"{metadata.version('transformers')}, torch {metadata.version('torch')}",
            "server": f"Python {py312}, openenv {openenv_s}, harbor {harbor}, mini-swe-agent {mswea}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,2,4,8", help="levels N, comma-separated")
    p.add_argument("--reps", type=int, default=3, help="repetitions per N (each measures both paths)")
    p.add_argument("--waves", type=int, default=1, help="rollouts timed per repetition, in units of N (at least 4)")
    p.add_argument("--sections", default="cli,script,stop,overhead,throughput,profile",
                   help="what to measure, comma-separated")
    p.add_argument("--script-runs", type=int, default=2, help="runs of the script for startup / shutdown")
    p.add_argument("--max-steps", type=int, default=2, help="optimizer steps per script run")
    p.add_argument("--py-spy", default="", help="py-spy binary: profile the server and the rollout child at max N")
    p.add_argument("--workdir", default="/tmp/agh-bench", help="rig logs, sandboxes, profiles")
    p.add_argument("--json", default="", help="write the raw numbers here")
    a = p.parse_args()
    sections = set(a.sections.split(","))
    levels = [int(x) for x in a.concurrency.split(",")]
    workdir = Path(a.workdir) / time.strftime("%Y%m%d-%H%M%S")
    info = versions()
    for k, v in info.items():
        print(f"{k}: {v}", flush=True)
    cli = {}
    if "cli" in sections:
        cli = cli_times()
        print("\n5. command line, median of 5: " + ", ".join(f"{k}={v:.2f}" for k, v in cli.items()), flush=True)

    recipe = hashlib.sha256((RIG / "tiny_model.py").read_bytes()).hexdigest()[:16]  # as tests/conftest.py keys it
    model_dir = Path(os.environ.get("AGH_CACHE_DIR", workdir)) / f"tiny-qwen3-{recipe}"
    subprocess.run([sys.executable, str(RIG / "tiny_model.py"), str(model_dir)], check=True)
    rig = Rig(workdir / "rig", model_dir, [], max_concurrent_envs=4 * max(levels))
    # py-spy costs CPU: "profile" samples one factory window at the highest N (rep 0), biasing that one window.
    profile = ({"py_spy": a.py_spy, "seconds": 20, "dir": workdir / "profile"}
               if a.py_spy and "profile" in sections else None)
    try:
        catalogue = script.fetch_catalogue(rig.harbor_url, rig.split)
        task = next(t for t in catalogue if t["task_name"] == TASK)
        spec = rollout_spec(rig, int(task["index"]))

        overhead, thr, runs = {}, {}, []
        print("\n2+3. script runs (startup, shutdown)", flush=True)
        embedded_modes = [False, True] if hasattr(script, "EmbeddedHarborServer") else [False]
        for _ in range(a.script_runs if "script" in sections else 0):
            for embedded in embedded_modes:
                wait_server_idle(rig)
                try:
                    runs.append(script_run(rig, model_dir, workdir, a.max_steps, embedded))
                except (RuntimeError, KeyError, subprocess.TimeoutExpired) as exc:
                    print(f"  script run (embedded={embedded}) failed: {exc!r}"[:4000], flush=True)
                    continue
                print("  " + json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                         for k, v in runs[-1].items()}), flush=True)
        if "overhead" in sections:
            print("\n4. factory overhead per rollout", flush=True)
            overhead = factory_overhead(rig, spec)
            for k, v in overhead["parts_ms"].items():
                print(f"  {k:50s} {v:8.3f} ms", flush=True)
            print(f"  server-side rollout: {overhead['server_wall_s']:.2f} s, {overhead['turns']} turns, phases "
                  f"{json.dumps(overhead['phase_timings'])}", flush=True)
        if "stop" in sections and a.py_spy:
            wait_server_idle(rig)
            print("\nworker stop under py-spy", flush=True)
            stop = profile_stop(rig, model_dir, [task], a.py_spy, workdir / "profile")
            print(f"  stop took {stop['stop_s']:.2f} s", flush=True)
            for leaf, share in stop["profile"]:
                print(f"  {share:6.1%}  {leaf}", flush=True)
        if "throughput" in sections:
            print("\n1. throughput", flush=True)
            thr = measure_throughput(rig, model_dir, [task], spec, levels, a.reps, a.waves, profile)

    finally:
        rig.stop()

    print("\nN  direct/min  factory/min  ratio  cpu(direct,factory)  latency s (direct,factory)")
    for n, r in thr.items():
        print(f"{n:<2} {r['direct_per_min']:10.2f} {r['factory_per_min']:12.2f} {r['ratio']:6.3f}  "
              f"{r['cpu_direct']:.0%},{r['cpu_factory']:.0%}  {r['latency_direct_s']:.2f},{r['latency_factory_s']:.2f}")
    if overhead and thr:
        wall = thr[min(levels)]["latency_direct_s"]
        overhead["fraction_of_rollout"] = overhead["total_ms"] / 1000 / wall
        print(f"factory overhead: {overhead['total_ms']:.2f} ms per rollout = {overhead['fraction_of_rollout']:.3%} "
              f"of a {wall:.2f} s rollout ({overhead['turns']} turns, {overhead['reply_bytes']} reply bytes)")
    med = {}
    for embedded in (False, True):
        mine = [r for r in runs if r["embedded"] == embedded]
        if mine:
            med[embedded] = {k: statistics.median(r[k] for r in mine) for k in mine[0]
                             if k not in ("embedded", "worker_stop_s", "steps")}
            print(f"script runs {'with' if embedded else 'without'} the embedded server, medians: "
                  + ", ".join(f"{k}={v:.2f}" for k, v in med[embedded].items()))
    prof = {}
    if profile:
        for name, proc in profile.get("procs", []):
            proc.wait(timeout=60)
            path = profile["dir"] / f"{name}.txt"
            if path.exists():
                prof[name] = summarise_profile(path)
                print(f"\nprofile {name} (self time share, {path}):")
                for leaf, share in prof[name]:
                    print(f"  {share:6.1%}  {leaf}")
    if a.json:
        Path(a.json).write_text(json.dumps({"info": info, "cli": cli, "throughput": thr, "overhead": overhead,
                                            "runs": runs, "medians": {str(k): v for k, v in med.items()},
                                            "profile": prof}, indent=1, default=str))
    ratio_min = min((r["ratio"] for r in thr.values()), default=float("nan"))
    base = med.get(False, {})
    print(f"perf: ratio_min={ratio_min:.3f} shutdown_s={base.get('shutdown_s', float('nan')):.2f} "
          f"startup_s={base.get('startup_script_s', float('nan')):.2f} help_s={cli.get('help_s', float('nan')):.2f} "
          f"refusal_s={cli.get('refusal_s', float('nan')):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
