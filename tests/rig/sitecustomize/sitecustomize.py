"""Applies the CPU rig's stand-ins in every Python process of a test run when AGH_CPU_RIG=1.

Put this directory on PYTHONPATH (it then also reaches TRL's spawned rollout-worker child, which inherits the
environment). `install()` only registers an import hook, so processes that never import TRL pay nothing.
"""

import os
import sys


def _chain_next_sitecustomize() -> None:
    # This file shadows any other sitecustomize further down sys.path; run that one too.
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.origin and os.path.abspath(spec.origin) != os.path.abspath(__file__):
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _install_rig(attention_only: bool) -> None:
    rig_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/rig
    if rig_dir not in sys.path:
        sys.path.append(rig_dir)
    import cpu_trainer

    cpu_trainer.install(cpu_trainer.ATTENTION_ONLY if attention_only else None)


_chain_next_sitecustomize()
if os.environ.get("AGH_CPU_RIG") in ("1", "attention"):
    _install_rig(attention_only=os.environ["AGH_CPU_RIG"] == "attention")
