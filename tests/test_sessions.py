"""The session factory speaks the interfaces TRL's rollout worker drives: every abstract method of OpenEnv's
`ResourceSession` and `ResourceSessionFactory`, with their parameters, and OpenEnv's `TrainableSession` protocol."""

from __future__ import annotations

import inspect

import pytest
from conftest import load_script
from openenv.core.harness import ResourceSession, ResourceSessionFactory, TrainableSession

agh = load_script()


@pytest.mark.parametrize("ours, interface", [("HarborSession", ResourceSession),
                                             ("HarborSessionFactory", ResourceSessionFactory)])
def test_every_method_of_the_openenv_interface_is_implemented_with_its_parameters(ours, interface):
    cls = getattr(agh, ours)
    assert not type("Checked", (cls, interface), {}).__abstractmethods__
    for name in interface.__abstractmethods__:
        theirs = list(inspect.signature(getattr(interface, name)).parameters)
        assert list(inspect.signature(getattr(cls, name)).parameters) == theirs, name


def test_a_session_is_what_trl_trains_on():
    assert issubclass(agh.HarborSession, TrainableSession)
