"""Test-only slow-downs for the SLURM tests' jobs (tests/integration/test_slurm.py), loaded by the job's Python
through PYTHONPATH. They cost wall time, not CPU, and patch genolong only once it is imported
(lazily: the start-up of ``genolong finetune`` stays as it is, with its signals caught first).

- ``GENOLONG_TEST_STEP_SLEEP=S``: sleep S seconds after each training batch, in a job's first run
  only (``SLURM_RESTART_COUNT`` unset or 0), so that a signal lands in the middle of training;
- ``GENOLONG_TEST_SLOW_SAVE=PATH``: while PATH exists, a checkpoint save waits 60 s between its
  data and its checksum manifest (its ``.ckpt.tmp`` written, not renamed): longer than KillWait.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time
from pathlib import Path


def _after(name: str, patch) -> None:
    """Call ``patch(module)`` once module ``name`` is imported (a one-shot meta path finder)."""

    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Hook())


_sleep = float(os.environ.get("GENOLONG_TEST_STEP_SLEEP", "0") or 0)
if _sleep and os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0"):

    def _slow_steps(module) -> None:
        metrics = module.StepMetrics
        end = metrics.on_train_batch_end

        def on_train_batch_end(self, *args, **kwargs):
            end(self, *args, **kwargs)
            time.sleep(_sleep)

        metrics.on_train_batch_end = on_train_batch_end

    _after("genolong.train.callbacks", _slow_steps)

_flag = os.environ.get("GENOLONG_TEST_SLOW_SAVE")
if _flag:

    def _slow_save(module) -> None:
        write = module.write_manifest

        def write_manifest(tmp, *args, **kwargs):
            if Path(_flag).exists():
                Path(str(_flag) + ".saving").write_text(str(tmp))
                time.sleep(60)
            return write(tmp, *args, **kwargs)

        module.write_manifest = write_manifest

    _after("genolong.train.finetune", _slow_save)
