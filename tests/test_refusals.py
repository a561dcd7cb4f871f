"""A setup that would train on nothing is refused before any weights load: one line saying what is wrong and what
to do, exit code 2, no traceback. `main()` runs in the test's own process (conftest.run_main); one refusal runs as
the command a user types."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest
from conftest import RIG, SCRIPT, free_port, load_script, run_main, run_script, script_env

RIG_TASKS = sum(1 for task in (RIG / "tasks").iterdir() if (task / "task.toml").is_file())


def assert_refused(proc, *needles: str) -> None:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0]
    assert "async_grpo_harbor\n" not in proc.stdout, "training set-up started"
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("args, needles", [
    (["--num-generations", "1"], ["--num-generations must be >= 2"]),
    (["--num-generations", "8", "--max-inflight", "4"], ["--max-inflight (4) must be >= --num-generations (8)"]),
    (["--temperature", "0"], ["--temperature must be > 0"]),
    (["--agent-step-limit", "-3"], ["--agent-step-limit must be >= 1"]),
    (["--max-inflight", "-2"], ["--max-inflight must be >= 1 (got -2)"]),
    (["--probe-rollout"], ["--probe-rollout is part of --check"]),
    (["--save-total-limit", "-1"], ["--save-total-limit must be >= 0 (got -1)"]),
    (["--harness", " , "], ["--harness is empty"]),
])
def test_impossible_settings(tmp_path, args, needles):
    assert_refused(run_main(args, cwd=tmp_path), *needles)


def test_a_refusal_is_one_line_and_exit_code_2_from_the_command_line(tmp_path):
    assert_refused(run_script(["--num-generations", "1"], cwd=tmp_path), "--num-generations must be >= 2")


@pytest.mark.parametrize("args, needle", [
    (["--lerning-rate", "1e-6"], "unrecognized arguments: --lerning-rate 1e-6"),
    (["--epsilon-high", "x"], "--epsilon-high: invalid float value: 'x'"),
    (["--logging-nan-inf-filter=maybe"], "--logging-nan-inf-filter: Truthy value expected: got maybe"),
    (["--seed", "0.5"], "--seed: invalid int value: '0.5'"),
    (["--optim", "adamw_torchh"], "--optim: invalid choice: 'adamw_torchh' (choose from 'adamw_torch', "),
])
def test_a_mistyped_flag_or_value_is_one_line_naming_it(tmp_path, args, needle):
    assert_refused(run_main(args, cwd=tmp_path), needle)


def test_unreachable_vllm_names_the_url_and_the_command(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    assert_refused(run_main(["--vllm-url", url], cwd=tmp_path), url, "vllm serve")


def test_unreachable_harbor_server(rig, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    assert_refused(run_main([*rig.base_args(), "--harbor-url", url], cwd=tmp_path), url, "openenv harbor serve")


@pytest.mark.parametrize("args, needles", [
    (["--harness", "mini-swe-agnt"], ["unknown harness 'mini-swe-agnt'", "this server has: mini-swe-agent,"]),
    (["--sandbox", "locl"], ["unknown sandbox 'locl'", "this server has: local,"]),
    (["--tasks", "coin,coin3"], ["--tasks: no task named 'coin3'", "did you mean coin"]),
    (["--tasks", "0-2,99"], ["--tasks: task index 99 is out of range", f"{RIG_TASKS} tasks"]),
    (["--tasks", "@missing.txt"], ["cannot read missing.txt"]),
    (["--dataset", "some/other-suite"], ["does not serve 'some/other-suite'"]),
    (["--model", "Qwen/Qwen3-4B-Instruct-2507"], ["vLLM serves", "but --model is Qwen/Qwen3-4B-Instruct-2507"]),
    (["--output-dir", "/proc/agh-out"], ["cannot write to /proc/agh-out", "writable --output-dir"]),
    (["--max-inflight", "9", "--num-generations", "2"], ["only 8 free session slots of the 9",
                                                         "MAX_CONCURRENT_ENVS=18"]),
    # Held-out evals run beside training, with as many rollouts in flight: the server must hold both.
    (["--max-inflight", "5", "--num-generations", "2", "--eval-tasks", "coin"], ["only 8 free session slots of the 10",
                                                                                "MAX_CONCURRENT_ENVS=20"]),
    (["--tasks", "coin", "--eval-tasks", "coin,coin3"], ["--eval-tasks: no task named 'coin3'", "did you mean coin"]),
])
def test_unknown_names_are_refused_with_the_valid_ones(rig, tmp_path, args, needles):
    assert_refused(run_main([*rig.base_args(), *args], cwd=tmp_path), *needles)


@pytest.mark.parametrize("content, needles", [
    ("# curated\ncoin\necho-hello  # always solved\n99\n", ["tasks.txt:4: task index 99 is out of range"]),
    ("coin\n\nthis is not a task\n", ["tasks.txt:3: no task named 'this is not a task'"]),
    ("# nothing but comments\n\n", ["tasks.txt lists no tasks"]),
])
def test_task_file_errors_name_the_line(rig, tmp_path, content, needles):
    (tmp_path / "tasks.txt").write_text(content)
    proc = run_main([*rig.base_args(), "--tasks", "@tasks.txt"], cwd=tmp_path)
    assert_refused(proc, *needles)


def test_output_dir_of_another_run_needs_resume(rig, tmp_path):
    (tmp_path / "out" / "checkpoint-7").mkdir(parents=True)
    (tmp_path / "out" / "checkpoint-7" / "trainer_state.json").write_text("{}")
    proc = run_main([*rig.base_args(), "--tasks", "coin", "--output-dir", "out"], cwd=tmp_path)
    assert_refused(proc, "already holds checkpoints", "--resume")
    assert (tmp_path / "out" / "checkpoint-7" / "trainer_state.json").read_text() == "{}"


def test_resume_without_checkpoint_says_what_it_looked_for(rig, tmp_path):
    proc = run_main([*rig.base_args(), "--tasks", "coin", "--output-dir", "out", "--resume"], cwd=tmp_path)
    assert_refused(proc, "--resume: no checkpoint-N in out")


def test_engine_without_token_ids_is_refused(eval_tier_rig, tmp_path):
    # Such an engine makes the proxy refuse every agent call: each rollout would burn its whole agent timeout
    # before returning reward 0 with no trainable turn.
    proc = run_main([*eval_tier_rig.base_args(), "--tasks", "coin"], cwd=tmp_path)
    assert_refused(proc, "--return-tokens-as-token-ids", "--logprobs-mode processed_logprobs")


def test_a_value_only_trls_config_refuses_is_one_line_on_every_rank_before_any_weights_load(rig, tmp_path):
    # AsyncGRPOConfig takes the scheduler's name as a plain string; only its construction knows the names, and
    # TrlParser builds it as it parses (its device set-up creates the process group on several GPUs). Two ranks, as
    # `accelerate launch` starts them: each must leave its process group behind cleanly, not abort at exit.
    args = [*rig.base_args(), "--tasks", "coin", "--lr-scheduler-type", "cosin", "--output-dir", "out"]
    dist = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=script_env(**dist, RANK=str(rank), LOCAL_RANK=str(rank)))
             for rank in (0, 1)]
    outputs = [proc.communicate(timeout=600) for proc in ranks]
    print(outputs)
    assert [proc.returncode for proc in ranks] == [2, 2]
    for stdout, stderr in outputs:
        errors = [line for line in stderr.splitlines() if line.startswith("error")]
        assert errors == [stderr.strip().splitlines()[-1]], stderr[-3000:]
        assert errors[0].startswith("error: AsyncGRPOConfig could not be built (TRL flags given: --lr-scheduler-type): "
                                    "cosin is not a valid SchedulerType")
        assert "Traceback" not in stdout + stderr and "terminate called" not in stderr
    assert not (tmp_path / "out" / "rollouts.jsonl").exists()


@pytest.mark.parametrize("args, needles", [
    (["--mod", "x"], ["unrecognized arguments: --mod x"]),  # never an abbreviation of --model
    (["--config", "missing.yaml"], ["--config missing.yaml", "No such file"]),
    (["--config", "bad.yaml"], ["--config bad.yaml: unknown key(s) agent_steps_limit"]),
    (["--gradient-accumulation-steps", "2"], ["--gradient-accumulation-steps 2", "from --micro-batches-per-step"]),
    (["--top-p", "0.9"], ["--top-p 0.9", "sets it to 1.0: the full vocabulary"]),
    # TRL's evaluation loop needs an eval dataset AsyncGRPOTrainer does not take: refused before any weights load.
    (["--eval-strategy", "steps"], ["--eval-strategy steps", "--eval-tasks SPEC --eval-steps N --eval-k K"]),
])
def test_trl_fields_and_recipes_are_refused_like_the_scripts_flags(tmp_path, args, needles):
    (tmp_path / "bad.yaml").write_text("learning_rate: 2.0e-6\nagent_steps_limit: 20\n")
    assert_refused(run_main(args, cwd=tmp_path), *needles)


def trl_config_of(argv: list[str]):
    """The AsyncGRPOConfig build_trainer would train with, for this command line (no model loads)."""
    from accelerate.state import PartialState

    agh = load_script()
    try:
        return agh.parse_args(argv).config
    finally:
        PartialState._reset_state()  # building a TrainingArguments picks this process's device


def test_every_trl_field_reaches_the_trainer_config_from_the_command_line():
    config = trl_config_of(["--run-name", "r", "--epsilon-high", "0.28", "--lr_scheduler_type", "cosine",
                            "--learning-rate", "3e-6"])
    assert (config.epsilon_high, config.lr_scheduler_type, config.learning_rate) == (0.28, "cosine", 3e-6)
    # The script's defaults and what it decides stay as they were.
    assert (config.max_steps, config.gradient_accumulation_steps, config.output_dir) == (500, 4, "runs/r")
    assert (config.epsilon, config.max_completion_length) == (0.2, 1024)


def test_use_peft_alone_trains_at_loras_learning_rate_on_a_bfloat16_base():
    """The README's quick start passes --use-peft and no --learning-rate: the adapters must not train at a full
    fine-tune's 1e-6, ten times too slow for LoRA. A rate or dtype the user gives wins."""
    lora = trl_config_of(["--run-name", "r", "--use-peft"])
    assert (lora.learning_rate, lora.dtype) == (1e-5, "bfloat16")
    given = trl_config_of(["--run-name", "r", "--use-peft", "--learning-rate", "3e-5", "--dtype", "float32"])
    assert (given.learning_rate, given.dtype) == (3e-5, "float32")
    assert trl_config_of(["--run-name", "r"]).learning_rate == 1e-6


def test_every_flag_parses_by_its_underscored_name_too_as_in_trl_scripts():
    """--name-with-dashes and --name_with_underscores both parse, as in TrlParser's scripts, and so do HF's booleans
    (bare, `false`)."""
    agh = load_script()
    dashed = agh.parse_args(["--run-name", "r", "--harbor-url", "http://h:1/", "--eval-k", "3", "--check", "false",
                             "--max-steps", "9", "--epsilon-high", "0.28"])
    underscored = agh.parse_args(["--run_name", "r", "--harbor_url", "http://h:1/", "--eval_k", "3", "--check",
                                  "false", "--max_steps", "9", "--epsilon_high", "0.28"])
    for args in (dashed, underscored):
        assert (args.harbor_url, args.eval_k, args.check, args.max_steps, args.trl) == (
            "http://h:1", 3, False, 9, {"epsilon_high": 0.28})
    assert agh.parse_args(["--check", "--probe_rollout"]).probe_rollout is True


def test_the_defaults_help_describes_are_this_machines():
    """--help says "this interpreter's `-m openenv.cli harbor serve`" and "the tasks.txt beside this script"; a run
    gets them on the machine it runs on."""
    args = load_script().parse_args(["--run-name", "r"])
    assert shlex.split(args.harbor_command) == [sys.executable, "-m", "openenv.cli", "harbor", "serve"]
    assert args.tasks == f"@{SCRIPT.with_name('tasks.txt')}"


def test_a_recipe_sets_script_flags_and_trl_fields_and_the_command_line_overrides_it(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("agent_step_limit: 20\nepsilon_high: 0.28\nmax_steps: 7\nlearning_rate: 2.0e-6\n")
    agh = load_script()
    args = agh.parse_args(["--config", str(recipe), "--max-steps", "9", "--run-name", "r"])
    assert (args.agent_step_limit, args.max_steps, args.learning_rate, args.trl) == (20, 9, 2e-6, {"epsilon_high": 0.28})
    config = trl_config_of(["--config", str(recipe), "--run-name", "r"])
    assert (config.epsilon_high, config.max_steps, config.learning_rate) == (0.28, 7, 2e-6)
