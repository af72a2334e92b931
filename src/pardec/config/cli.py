"""The command line's config errors: what Hydra refuses in one line (:func:`hydra_errors_in_one_line`) and a user error
printed as one line with exit status 2 (:func:`exit_with_error`)."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf, open_dict

from pardec import CONF_DIR
from pardec.config.checks import ConfigError


def exit_with_error(e: Exception) -> NoReturn:
    """A user error at the command line: ``error: <message>`` on stderr, exit status 2, no traceback wall (set
    HYDRA_FULL_ERROR=1 for one)."""
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


#: errno values of a file system that refuses a write (as :func:`fs_error` words them)
FS_ERRORS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR, errno.EISDIR,
             errno.ENOENT, errno.EEXIST}


def fs_error(e: OSError) -> str:
    """One line for a refused write: the path, the reason, and for a full disk that what was written is kept."""
    path = e.filename if e.filename is not None else "?"
    extra = f" -> {e.filename2}" if e.filename2 else ""
    hint = ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = ("; the records written so far are kept: free space, then rerun with resume=true and the same "
                "hydra.run.dir")
    elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        hint = "; point hydra.run.dir (and paths.output_dir / paths.data_dir) at a writable directory"
    elif e.errno == errno.ENOTDIR:
        hint = "; a component of the path is a file, not a directory"
    return f"cannot write {path}{extra}: {e.strerror or e}{hint}"


#: config group options of earlier releases -> their names now (``+method=eagle``: one line naming ``eagle3``)
RENAMED_OPTIONS = {"method/eagle": "eagle3", "draft/eagle": "eagle3", "kind/heads": "drafter", "trainer/heads": "drafter"}
#: training config keys / sections of earlier releases -> their names now (the longest matching prefix names the new
#: spelling): ``python -m train`` refuses them naming the new one; ``python -m pardec.zoo rehash`` applies them
OLD_KEYS = {"distill.loss": "trainer.loss", "distill": "completions", "heads": "drafter"}


@contextmanager
def hydra_errors_in_one_line() -> Iterator[None]:
    """Around a Hydra app (``@hydra.main``) or a ``compose``: what Hydra refuses while composing (a config group
    option that does not exist, a key the config lacks, a malformed override, a sweep without ``-m``) raises a
    :class:`ConfigError` in one line naming it and listing the valid options, where Hydra's own messages span many
    lines and suggest a stack trace. The app's composition is the check: no second one before it (a composition
    costs ~0.25 s). An error a Hydra app raises passes through (HYDRA_FULL_ERROR is set meanwhile), so the app's own
    unexpected errors show their whole traceback."""
    before = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    except MissingConfigException as e:
        group, _, option = (e.missing_cfg_file or "").rpartition("/")
        if f"{group}/{option}" in RENAMED_OPTIONS:
            raise ConfigError(f"{group}={option!r} is now named {RENAMED_OPTIONS[f'{group}/{option}']!r}") from None
        if group and e.options:
            raise ConfigError(f"{group}={option!r} is not valid; choose one of: {', '.join(e.options)}") from None
        raise ConfigError(" ".join(str(e).split("Config search path")[0].split())) from None
    except HydraException as e:
        where = f"override {e.override!r}: " if getattr(e, "override", None) else ""  # a parse error names no key
        cause = f" ({str(e.__cause__).splitlines()[0]})" if e.__cause__ else ""
        raise ConfigError(where + " ".join(str(e).split()) + cause) from None
    except (OSError, ValueError) as e:  # the file system refused a write (Hydra's log file setup wraps it)
        fs = e if isinstance(e, OSError) else e.__cause__ or e.__context__
        if not (isinstance(fs, OSError) and fs.errno in FS_ERRORS):
            raise
        raise ConfigError(fs_error(fs)) from None
    finally:
        if before is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = before


def run_hydra_app(app) -> None:
    """Run a Hydra app (an ``@hydra.main`` function) from a command line: what Hydra refuses while composing is one
    ``error:`` line and exit status 2 (:func:`hydra_errors_in_one_line`, :func:`exit_with_error`)."""
    try:
        with hydra_errors_in_one_line():
            app()
    except ConfigError as e:
        exit_with_error(e)


def check_overrides(argv: list[str], config_name: str) -> None:
    """Compose ``config_name`` with the overrides ``argv`` as Hydra would, raising what it would refuse as one
    :class:`ConfigError` line (:func:`hydra_errors_in_one_line`)."""
    with hydra_errors_in_one_line(), initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        compose(config_name, overrides=list(argv))


def composed(app: str, overrides: list[str]):
    """The resolved config ``python -m <app> <overrides>`` runs with, as a DictConfig without its ``hydra`` section
    (``${hydra:runtime.choices...}`` resolved as a run resolves it); for tools and tests that compose a run's config
    outside the app. The app's resolvers must be registered: import ``pardec.train`` / ``pardec.evaluate`` first."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose(app, overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # for ${hydra:runtime.choices.experiment}
    try:
        with open_dict(cfg):
            del cfg["hydra"]
        OmegaConf.resolve(cfg)
        return cfg
    finally:
        HydraConfig.instance().cfg = None  # leave no global state behind
