"""The rig's sandbox stand-in starts the pre-installed agent warm (tests/rig/agent_zygote.py), and that start keeps
the sandbox's contract: the agent is the real mini-swe-agent, answering as a cold start does, it sees only its own
trial's tree, and it ends with its exec or with the sandbox."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

DRIVER = Path(__file__).resolve().parent / "rig_sandbox_driver.py"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    proc = subprocess.run([os.environ["AGH_SERVER_PYTHON"], str(DRIVER), str(tmp_path_factory.mktemp("boxes"))],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "started cold" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("args", ["--bogus", "--help"])
def test_a_warm_agent_start_answers_as_a_cold_one(report, args):
    (warm_code, warm_out, warm_err), (cold_code, cold_out, cold_err) = report[args]
    assert (warm_code, warm_out, warm_err) == (cold_code, cold_out, cold_err)
    assert warm_code == (2 if args == "--bogus" else 0)


def test_a_warm_agent_sees_only_its_own_trial(report):
    # The agent creates its config dir at import: inside its own trial's tree, not another's nor the host's.
    assert report["config dir"] == {"a": True, "b": False, "host": False}
    assert not report["cancelled"]["b sees it"]


def test_the_agent_is_forked_from_the_warm_process_and_ends_with_its_exec_or_sandbox(report):
    for ending in ("cancelled", "stopped"):
        assert report[ending]["forked from"] == "agent_zygote.py", report[ending]
    assert report["cancelled"]["left"] == {}, "a cancelled exec left processes in the sandbox"
