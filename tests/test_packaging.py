"""The script installs as its PEP 723 header says: pins that exist on the registry and resolve together."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from conftest import ROOT, SCRIPT, load_script

# Imported on the GPU path by what the script runs, but not by this script's configuration (none since --use-peft).
NOT_ON_OUR_PATH: set[str] = set()


def trainer_imports() -> set[str]:
    """Top-level modules that TRL's AsyncGRPO package and the script import anywhere, lazily or behind an
    availability guard included: the GPU path imports what the CPU rig skips (`kernels` for tree attention, vLLM's
    NCCL helpers for the weight push)."""
    import trl

    files = [*(Path(trl.__file__).parent / "experimental" / "async_grpo").glob("*.py"), SCRIPT]
    names = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__"} - NOT_ON_OUR_PATH


def test_header_dependencies_resolve_together(tmp_path):
    script = tmp_path / SCRIPT.name
    shutil.copy(SCRIPT, script)
    # The header asks for Python >= 3.12; uv must not try to download one, so it is handed the rig's 3.12. Its
    # cache outlives the run, so a rerun resolves from cached metadata in seconds.
    cache = Path(os.environ.get("AGH_CACHE_DIR") or tmp_path) / "uv"
    proc = subprocess.run([sys.executable, "-m", "uv", "lock", "--script", str(script), "--python",
                           os.environ["AGH_SERVER_PYTHON"]], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "UV_PYTHON_DOWNLOADS": "never", "UV_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lock = tomllib.loads(script.with_name(script.name + ".lock").read_text())
    versions = {p["name"]: p["version"] for p in lock["package"]}
    assert versions["trl"] == "1.16.0"
    assert versions["openenv"] == "0.10.0"
    assert versions["vllm"] == "0.29.0"
    assert versions["harbor"] == "0.25.0"
    assert {"harbor", "e2b", "trackio", "torch", "transformers"} <= set(versions)
    assert not [p["name"] for p in lock["package"] if "git" in p.get("source", {})], "git dependency"
    # Every module the trainer imports, on the GPU path too, comes from a locked distribution (a module not
    # installed here is assumed to be its distribution's name, as kernels and vllm are).
    installed = importlib.metadata.packages_distributions()
    needed = {module: [canonical(d) for d in installed.get(module, [module])] for module in trainer_imports()}
    assert {"kernels", "vllm", "torch", "transformers"} <= set(needed), needed
    missing = {module: dists for module, dists in needed.items() if not set(dists) & set(versions)}
    assert not missing, f"imported but not locked: {missing}"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# Libraries whose private code the script calls or overrides (TRL's experimental trainer, transformers' Trainer
# internals, accelerate's dataloader, torch's default process group): any release may change that code under it.
PRIVATE_CODE_OVERRIDDEN = {"trl", "transformers", "accelerate", "torch"}
# Pinned in the header but not installed in the rig's trainer environment (tests/envs.sh leaves them out): vllm is
# CUDA-only; harbor runs in the Harbor server's environment (Python 3.12), where the test below checks it.
NOT_IN_THE_RIG = {"vllm", "harbor"}


def header_dependencies() -> list[str]:
    """The script's PEP 723 `dependencies`, read the way the PEP's reference implementation reads its block."""
    block = re.search(r"(?m)^# /// script$\s(?P<content>(^#(| .*)$\s)+)^# ///$", SCRIPT.read_text())
    content = "".join(line[2:] if line.startswith("# ") else line[1:]
                      for line in block["content"].splitlines(keepends=True))
    return tomllib.loads(content)["dependencies"]


def exact_pins(requirements: list[str]) -> dict[str, str]:
    """name -> version of each `name==version` (extras ignored) among requirement lines."""
    pins = {}
    for line in requirements:
        if m := re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==([^\s;#]+)", line.split("#")[0].strip()):
            pins[canonical(m[1])] = m[2]
    return pins


def test_the_test_environment_runs_the_versions_the_header_pins():
    pins = exact_pins(header_dependencies())
    assert PRIVATE_CODE_OVERRIDDEN <= set(pins), f"not pinned exactly: {PRIVATE_CODE_OVERRIDDEN - set(pins)}"
    # tests/envs.sh installs the header's pins: the suite tests the versions `uv run` installs for a user.
    wanted = {name: version for name, version in pins.items() if name not in NOT_IN_THE_RIG}
    installed = {name: importlib.metadata.version(name).split("+")[0] for name in wanted}  # 2.13.0+cpu is 2.13.0
    assert installed == wanted, f"the header pins {wanted}, the test environment has {installed}"
    # One place: the test requirements list none of them again, so the two cannot drift apart.
    listed = (SCRIPT.parent / "tests" / "requirements-trainer.txt").read_text().splitlines()
    again = {canonical(re.split(r"[\[=<>!~;\s]", line.strip(), 1)[0]) for line in listed
             if line.strip() and not line.startswith("#")} & set(pins)
    assert not again, f"tests/requirements-trainer.txt lists {again}, pinned in the script's header"


def test_the_harbor_server_of_the_tests_runs_the_harbor_the_header_pins():
    """openenv[harbor] asks only harbor>=0.22.0; Harbor decides how sandboxes start and harnesses install, so the
    header pins the one the tests' Harbor server runs."""
    pins = exact_pins(header_dependencies())
    served = exact_pins((ROOT / "tests" / "requirements-server.txt").read_text().splitlines())
    installed = subprocess.run([os.environ["AGH_SERVER_PYTHON"], "-c", "import importlib.metadata as m; "
                                "print(m.version('harbor'), m.version('openenv'))"],
                               capture_output=True, text=True, check=True).stdout.split()
    assert pins.get("harbor") == served["harbor"] == installed[0], (pins.get("harbor"), served, installed)
    assert pins["openenv"] == installed[1]


@functools.cache
def script_help() -> subprocess.CompletedProcess:
    """`async_grpo_harbor.py --help`, run once for the tests that read it."""
    return subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=300)


def test_help_documents_every_flag():
    proc = script_help()
    assert proc.returncode == 0
    flags = set(re.findall(r"(?:^  |, )(--[\w-]+)", proc.stdout, re.M))
    for flag in ("--model", "--vllm-url", "--harbor-url", "--dataset", "--split", "--tasks", "--harness",
                 "--sandbox", "--reward-key", "--num-generations", "--max-inflight", "--max-staleness",
                 "--temperature", "--max-completion-length", "--agent-step-limit", "--agent-timeout",
                 "--learning-rate", "--max-steps", "--save-steps", "--output-dir", "--run-name", "--project",
                 "--resume", "--dtype", "--save-total-limit", "--harbor-expose", "--use-peft", "--lora-r",
                 "--lora-alpha", "--lora-dropout", "--lora-target-modules", "--use-rslora"):
        assert flag in flags, flag


def test_help_lists_every_trl_field_and_none_the_script_sets():
    """As in TRL's scripts, every AsyncGRPOConfig field is a flag --help lists; a field the script sets is none."""
    flags = set(help_entries())
    assert {"--epsilon-high", "--lr-scheduler-type", "--seed", "--lora-r"} <= flags
    assert not {"--top-p", "--gradient-accumulation-steps", "--eval-strategy", "--logging-steps"} & flags


def shell_commands(text: str) -> list[str]:
    """Each command line of `text`, its backslash continuations joined and its whitespace collapsed; comments out."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [" ".join(line.split()) for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


# The README is the quick start; what it links to carries the rest, commands included.
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "slurm" / "README.md",
        ROOT / "tests" / "README.md"]


def doc_commands(paths: list[Path] = DOCS) -> list[str]:
    """Every command line of the ```bash blocks of `paths`."""
    return [c for path in paths for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S)
            for c in shell_commands(block)]


def readme_commands() -> list[str]:
    """The README's own commands: the quick starts a newcomer copies."""
    return doc_commands([ROOT / "README.md"])


def vllm_serve(command: str) -> tuple[set[str], list[str]]:
    """The environment a `vllm serve` command sets and what follows `serve` (model and flags), however vLLM is run."""
    words = shlex.split(command)
    env = {w for w in words[:words.index("vllm")] if re.fullmatch(r"[A-Z_]+=\S*", w)}
    return env, words[words.index("serve") + 1:]


def help_entries() -> dict[str, str]:
    """Each flag `--help` lists, by each spelling it shows, and its entry (the lines up to the next flag, joined)."""
    proc = script_help()
    assert proc.returncode == 0, proc.stderr[-3000:]
    entries = [entry for entry in re.split(r"\n(?=  -)", proc.stdout) if entry.startswith("  -")]
    return {flag: " ".join(entry.split()) for entry in entries
            for flag in re.findall(r"--[\w-]+", re.split(r"\s{2,}|\n", entry.strip())[0])}


def help_default(flag: str) -> str:
    return re.search(r"\(default: ([^)]*)\)", help_entries()[flag])[1]


def test_every_docs_page_a_flags_help_names_exists():
    """A help is a sentence or two; what it cannot hold lives in docs/, and the page (for docs/flags.md, the flag's
    own heading) it names is there."""
    script = load_script()
    flags_md = (ROOT / "docs" / "flags.md").read_text()
    headings = set(re.findall(r"^#+ `(--[\w-]+)", flags_md, re.M))
    fields = [f for cls in (script.ScriptArguments, script.HarborGRPOConfig)
              for f in dataclasses.fields(cls) if f.init and f.name in cls.__annotations__]
    pointing = set()
    for f in fields:
        flag, help_text = f"--{f.name.replace('_', '-')}", f.metadata["help"].split(" (default:")[0]
        assert len(help_text) <= 240, (flag, help_text)
        for page in re.findall(r"docs/[\w-]+\.md", help_text):
            assert (ROOT / page).exists(), (flag, page)
            pointing |= {flag} if page == "docs/flags.md" else set()
    assert {"--dtype", "--harbor-expose", "--delta"} <= pointing
    assert pointing - headings == set(), "a help names docs/flags.md, which has no heading for its flag"
    assert headings - {f"--{f.name.replace('_', '-')}" for f in fields} == set(), "a heading for no flag"


def test_no_default_in_help_names_this_machine():
    """What --help prints is the same on every machine: defaults that depend on it are described, not printed."""
    out = script_help().stdout
    for path in {sys.prefix, sys.executable, str(SCRIPT.parent), str(Path.home())}:
        assert path not in out, path
    assert help_default("--harbor-command") == "this interpreter's `-m openenv.cli harbor serve`"


def weight_transfer_backend(flags: list[str]) -> str:
    return json.loads(flags[flags.index("--weight-transfer-config") + 1])["backend"]


def test_readme_runs_the_commands_of_the_scripts_docstring():
    """A user copies from either; both must say the same. The docstring runs vLLM from the environment, the README
    pins it with uvx: the environment it sets, the model and every flag must match, one GPU (ipc) first, then two
    (nccl)."""
    docstring = shell_commands(ast.get_docstring(ast.parse(SCRIPT.read_text())))
    readme = readme_commands()
    doc_vllm = [vllm_serve(c) for c in docstring if " vllm serve " in f" {c} "]
    readme_vllm = [vllm_serve(c) for c in readme if " vllm serve " in f" {c} "]
    assert [weight_transfer_backend(flags) for _, flags in doc_vllm] == ["ipc", "nccl"], doc_vllm
    assert readme_vllm == doc_vllm
    runs = [c for c in docstring if "uv run async_grpo_harbor.py" in c]
    assert len(runs) >= 4, runs
    assert [c for c in runs if c not in readme] == []


def test_the_one_gpu_vllm_is_bound_to_this_host_and_leaves_the_trainer_its_share():
    """The ipc backend unpickles what it is sent: exposed beyond the host it would run code for anyone who reaches
    the port. Its utilisation is a fraction of the card's total, so it is set, not vLLM's default 0.92."""
    env, flags = next(v for v in (vllm_serve(c) for c in readme_commands() if " vllm serve " in f" {c} ")
                      if weight_transfer_backend(v[1]) == "ipc")
    assert {"VLLM_SERVER_DEV_MODE=1", "VLLM_ALLOW_INSECURE_SERIALIZATION=1"} <= env
    assert not any(e.startswith("CUDA_VISIBLE_DEVICES=") for e in env), "one GPU: the trainer's is vLLM's"
    assert flags[flags.index("--host") + 1] == "127.0.0.1"
    assert float(flags[flags.index("--gpu-memory-utilization") + 1]) <= 0.5


def test_every_vllm_the_docs_run_on_the_trainers_host_is_bound_to_it():
    """vLLM in dev mode (the weight push needs it) serves /collective_rpc and the weight-transfer routes to whoever
    reaches its port, whatever the backend: each `vllm serve` a doc or the docstring shows runs beside the trainer and
    binds loopback (vLLM's default binds every interface). Multi-node runs are slurm/multi_node.sbatch's."""
    docstring = shell_commands(ast.get_docstring(ast.parse(SCRIPT.read_text())))
    served = [vllm_serve(c)[1] for c in [*doc_commands(), *docstring] if " vllm serve " in f" {c} "]
    assert len(served) >= 4, served
    unbound = [flags for flags in served if "--host" not in flags or flags[flags.index("--host") + 1] != "127.0.0.1"]
    assert unbound == [], unbound


def test_the_readme_names_the_driver_the_trainer_gpu_row_asks_for():
    """torch 2.13's wheels (the header's pin) are built for CUDA 13.0: a driver older than its floor leaves torch
    without a GPU. The README says which driver before anyone rents a card; the row names it when it is missing."""
    floor = load_script().CUDA_DRIVER_FLOOR[13]
    gpus = " ".join((ROOT / "README.md").read_text().split("- **Which GPUs**", 1)[1].split("\n- ", 1)[0].split())
    assert f"built for CUDA 13.0, which needs NVIDIA driver >= {floor} on Linux" in gpus, gpus


def test_readme_vllm_commands_are_the_ones_the_gpu_tests_serve():
    """tests/gpu proves the README's vLLM flags on real GPUs: each GPU test that declares README_FLAGS serves exactly
    the README command of its weight-transfer backend."""
    readme = {weight_transfer_backend(flags): flags[1:] for _, flags in
              (vllm_serve(c) for c in readme_commands() if " vllm serve " in f" {c} ")}  # the model first
    proven = []
    for path in sorted((SCRIPT.parent / "tests" / "gpu").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        for gpu_flags in [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                          and getattr(n.targets[0], "id", "") == "README_FLAGS"]:
            backend = weight_transfer_backend(gpu_flags)
            flags = readme[backend]
            assert all(f in flags for f in gpu_flags), (path.name, set(gpu_flags) - set(flags))
            assert {f for f in flags if f.startswith("--")} - {f for f in gpu_flags if f.startswith("--")} <= \
                {"--port", "--max-model-len", "--host", "--gpu-memory-utilization"}, path.name
            proven.append(backend)
    assert "nccl" in proven, proven


def test_what_the_docs_say_of_each_left_out_vllm_flag_is_what_the_gpu_test_proves():
    """tests/gpu/test_two_gpus.py starts a vLLM without each flag of MISSING_FLAG and requires its row to FAIL; the
    README's flags that no case leaves out (on vLLM 0.26 one of them failed no row: bench/results/2026-11-30-h200.md)
    are named as exceptions wherever the docs say that leaving a flag out fails its row."""
    tree = ast.parse((ROOT / "tests" / "gpu" / "test_two_gpus.py").read_text())
    assigned = {n.targets[0].id: n.value for n in tree.body if isinstance(n, ast.Assign)
                and isinstance(n.targets[0], ast.Name)}
    flags = ast.literal_eval(assigned["README_FLAGS"])
    cases = eval(compile(ast.Expression(assigned["MISSING_FLAG"]), "MISSING_FLAG", "eval"),  # literals and `dict`
                 {"README_FLAGS": flags, "dict": dict})
    left_out = {f for kwargs, _, _ in cases.values() for f in set(flags) - set(kwargs.get("flags", flags))}
    unproven = sorted(f for f in flags if f.startswith("--") and f not in left_out)
    assert unproven == ["--return-tokens-as-token-ids"], unproven
    readme = " ".join((ROOT / "README.md").read_text().split("- **Every vLLM flag matters**", 1)[1]
                      .split("\n- ", 1)[0].split())
    tests_readme = " ".join((ROOT / "tests" / "README.md").read_text().split("**On two GPUs**", 1)[1]
                            .split("\n\n", 1)[0].split())
    for text in (readme, tests_readme):
        claim = re.search(r"leaving one out failed its row with its fix|each flag left out FAILs its own row with "
                          r"its fix", text)
        assert claim, text
        assert text[claim.end():].startswith(", except " + ", ".join(f"`{f}`" for f in unproven)), text


def test_the_default_task_list_says_which_dataset_revision_its_indices_mean_and_how_to_pin_one():
    """openenv 0.10 serves a hub dataset's main branch and takes no revision; a folder it serves as it is. tasks.txt
    says what its indices mean, and docs/flags.md downloads the suite at one commit and serves that folder, with
    commands the installed `hf` CLI takes."""
    script = load_script()
    revision = [line for line in (ROOT / "tasks.txt").read_text().splitlines() if line.startswith("# Revision:")]
    assert revision, "tasks.txt names no revision"
    section = (ROOT / "docs" / "flags.md").read_text().split("### `--dataset`", 1)[1].split("\n## ", 1)[0]
    commands = doc_commands_of(section)
    download = shlex.split(next(c for c in commands if c.startswith("hf download ")))
    assert download[2] == script.DEFAULT_DATASET and download[download.index("--repo-type") + 1] == "dataset"
    assert download[download.index("--include") + 1] == "tasks/**"  # what openenv's own download fetches
    assert "--revision" in download
    run = shlex.split(next(c for c in commands if c.startswith("uv run async_grpo_harbor.py")))
    assert run[run.index("--dataset") + 1] == download[download.index("--local-dir") + 1]
    assert run[run.index("--tasks") + 1] == "@tasks.txt"  # beside the script, the clone's root
    hf = Path(sys.executable).with_name("hf")
    for command in (download[:2], ["hf", "datasets", "info"]):
        usage = subprocess.run([str(hf), *command[1:], "--help"], capture_output=True, text=True, timeout=120)
        assert usage.returncode == 0, usage.stderr
    usage = subprocess.run([str(hf), "download", "--help"], capture_output=True, text=True, timeout=120).stdout
    assert all(flag in usage for flag in ("--repo-type", "--revision", "--include", "--local-dir")), usage


def doc_commands_of(markdown: str) -> list[str]:
    return [c for block in re.findall(r"```bash\n(.*?)```", markdown, re.S) for c in shell_commands(block)]


def test_readme_harbor_server_gets_the_settings_the_script_gives_its_own():
    """A server the user runs must cap each agent turn at --max-completion-length (openenv's default is 8,192, which
    the trainer's memory plan does not expect and the server cannot report) and hold twice --max-inflight
    sessions, as EmbeddedHarborServer starts it."""
    serve = [c for c in doc_commands() if "openenv harbor serve" in c]
    assert serve
    for command in serve:
        words = shlex.split(command)
        assert words[words.index("--max-output-tokens") + 1] == help_default("--max-completion-length")
        envs = dict(w.split("=", 1) for w in words[:words.index("openenv")] if "=" in w)
        assert int(envs["MAX_CONCURRENT_ENVS"]) >= 2 * int(help_default("--max-inflight"))
        # e2b templates shared per environment, and the harness version the script's own server pins.
        assert envs["HARBOR_SHARED_ENV_NAME"] == load_script().SHARED_TEMPLATE_NAME
        assert json.loads(envs["OPENENV_HARBOR_AGENT_VERSIONS"]) == load_script().HARNESS_VERSIONS


def test_the_readme_test_command_is_what_ci_runs():
    """A newcomer runs the README's test command; CI runs that command and nothing else, so the two cannot drift."""
    assert "bash tests/run.sh" in readme_commands()
    ci = [c for c in shell_commands((ROOT / ".ci" / "run").read_text()) if c.startswith("exec ")]
    assert ci == ["exec bash tests/run.sh"], ci


def anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation but `-` and `_` dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_of_the_docs_resolves():
    """A link moved with its section would otherwise point at a file or heading that is no longer there."""
    broken = []
    for path in [*DOCS, ROOT / "bench" / "results" / "README.md"]:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # a link inside a code block is not one
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, fragment = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
            elif fragment and linked.suffix == ".md" and fragment not in {
                    anchor(h) for h in re.findall(r"(?m)^#+ (.*)$", re.sub(r"```.*?```", "", linked.read_text(),
                                                                            flags=re.S))}:
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_every_test_a_doc_names_exists():
    """Each promise names its test: a renamed or deleted test must not leave a promise pointing at nothing."""
    defined = {f"{path.name}::{node.name}" for path in [*ROOT.glob("tests/test_*.py"), *ROOT.glob("tests/gpu/test_*.py")]
               for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}
    named = {(path.relative_to(ROOT), name) for path in DOCS
             for name in re.findall(r"(test_\w+\.py::test_\w+)", path.read_text())}
    assert named, "the docs name their tests"
    missing = sorted(f"{path}: {name}" for path, name in named if name.removeprefix("tests/") not in defined)
    assert not missing, missing



def test_what_the_readme_says_you_will_see_is_copied_from_the_gpu_run_it_links():
    """The README's sample output is a real GPU run's, not the CPU rig's nor edited: each of its lines stands, as it
    is, in the log the section links from bench/results."""
    section = (ROOT / "README.md").read_text().split("## What you will see", 1)[1].split("\n## ", 1)[0]
    [log] = re.findall(r"\]\((bench/results/[^)]+\.log)\)", section)
    assert "gpu" in log, log
    [block] = re.findall(r"```\n(.*?)```", section, flags=re.S)
    recorded = set((ROOT / log).read_text().splitlines())
    assert [line for line in block.splitlines() if line not in recorded] == []
