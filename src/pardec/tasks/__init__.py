"""Benchmarks. Importing this package registers every built-in task in :data:`TASKS`."""

import importlib
import pkgutil

from pardec.tasks.base import TASKS, Task, build_task, register_task  # noqa: F401

# each module in this package registers its task(s); new task files need no edit here
for _m in pkgutil.iter_modules(__path__):
    if _m.name != "base":
        importlib.import_module(f"{__name__}.{_m.name}")
