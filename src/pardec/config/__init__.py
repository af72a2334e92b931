"""Structured configs, by concern: :mod:`.schema` (the dataclasses a Hydra section becomes, the choice tuples they
check against), :mod:`.checks` (:class:`ConfigError` and the one style of check every part of pardec uses: types,
choices, ranges), :mod:`.cli` (the command line's one-line errors and Hydra override checks) and :mod:`.launch`
(a process's place in a multi-process launch: :class:`Ranks`). A bad value fails before any model loads, naming the
key, the value and the valid choices. The names below are the public API: import them from ``pardec.config``.
"""

from pardec.config.checks import (
    ConfigError,
    check_at_least,
    check_choice,
    check_range,
    check_types,
    fits_type,
    is_int,
    key_name,
    to_dataclass,
    type_hints,
    type_name,
)
from pardec.config.cli import (
    check_overrides,
    composed,
    exit_with_error,
    hydra_errors_in_one_line,
    run_hydra_app,
)
from pardec.config.launch import SYNC_TIMEOUT, Ranks, launcher_argv, shared_launch_id
from pardec.config.schema import (
    ATTN_IMPLEMENTATIONS,
    DEVICE_MAPS,
    DEVICES,
    DTYPES,
    FORWARD_CHOICES,
    FORWARD_IMPLS,
    INT8_FIELDS,
    INT8_WEIGHTS,
    KV_CACHES,
    MODEL_SOURCES,
    PROMPT_STYLES,
    BenchConfig,
    DatasetConfig,
    ModelConfig,
    RunConfig,
    SamplingConfig,
    settings_diff,
)

__all__ = [
    "ATTN_IMPLEMENTATIONS", "DEVICES", "DEVICE_MAPS", "DTYPES", "FORWARD_CHOICES", "FORWARD_IMPLS", "INT8_FIELDS",
    "INT8_WEIGHTS", "KV_CACHES", "MODEL_SOURCES", "PROMPT_STYLES", "SYNC_TIMEOUT", "BenchConfig", "ConfigError",
    "DatasetConfig", "ModelConfig", "Ranks", "RunConfig", "SamplingConfig", "check_at_least", "check_choice",
    "check_overrides", "check_range", "check_types", "composed", "exit_with_error", "fits_type",
    "hydra_errors_in_one_line",
    "is_int", "key_name", "launcher_argv", "run_hydra_app", "settings_diff", "shared_launch_id", "to_dataclass", "type_hints", "type_name",
]
