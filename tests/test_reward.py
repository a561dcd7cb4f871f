"""harbor_reward: the verifier's reward, plus a bounded bonus for solving in fewer turns."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import load_script

agh = load_script()


def outcome(reward, turns):
    return SimpleNamespace(env_reward=reward, trace=[{}] * turns, tool_call_count=turns)


def reward(r, turns, w=0.1, limit=10):
    return agh.harbor_reward(outcome(r, turns), step_limit=limit, efficiency_weight=w)


def test_unscorable_stays_unscorable():
    assert reward(None, 3) is None


def test_unsolved_rollouts_get_no_bonus_however_short():
    assert reward(0.0, 1) == 0.0
    assert reward(-1.0, 1) == -1.0


def test_solving_faster_earns_more_but_never_more_than_the_weight():
    fast, slow, at_limit = reward(1.0, 2), reward(1.0, 8), reward(1.0, 10)
    assert 1.0 == at_limit < slow < fast <= 1.1
    assert reward(1.0, 30) == 1.0  # past the limit: no negative bonus


def test_bonus_scales_with_partial_credit_and_can_be_disabled():
    assert reward(0.5, 2) == pytest.approx(0.5 + 0.1 * 0.5 * 0.8)
    assert reward(1.0, 2, w=0.0) == 1.0
