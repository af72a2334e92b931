"""The command line's config errors: Hydra's overrides checked in one line (:func:`check_overrides`) and a user error
printed as one line with exit status 2 (:func:`exit_with_error`)."""

from __future__ import annotations

import sys
from typing import NoReturn

from pardec.config.checks import ConfigError


def exit_with_error(e: Exception) -> NoReturn:
    """A user error at the command line: ``error: <message>`` on stderr, exit status 2, no traceback wall (set
    HYDRA_FULL_ERROR=1 for one)."""
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def check_overrides(argv: list[str], config_name: str) -> None:
    """Compose ``config_name`` with the command line's overrides as Hydra is about to, so that what Hydra would
    refuse (a config group option that does not exist, a key the config lacks, a malformed override) fails in
    one line naming it, listing the valid options (Hydra's own messages span many lines and suggest a stack
    trace). A command line with flags (``-m``, ``--cfg``, ...) is left to Hydra."""
    if any(a.startswith("-") for a in argv):
        return
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException

    from pardec import CONF_DIR

    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            compose(config_name, overrides=list(argv))
    except MissingConfigException as e:
        group, _, option = (e.missing_cfg_file or "").rpartition("/")
        if group and e.options:
            raise ConfigError(f"{group}={option!r} is not valid; choose one of: {', '.join(e.options)}") from None
        raise ConfigError(" ".join(str(e).split("Config search path")[0].split())) from None
    except HydraException as e:
        where = f"override {e.override!r}: " if getattr(e, "override", None) else ""  # a parse error names no key
        cause = f" ({str(e.__cause__).splitlines()[0]})" if e.__cause__ else ""
        raise ConfigError(where + " ".join(str(e).split()) + cause) from None
