"""The config checks every part of pardec shares, one style: each error is one line naming the key, the bad value
and what is valid (the choices, the range or the type).

* :func:`check_types`: values against a dataclass's field annotations or a function's parameter annotations
  (:func:`fits_type`, :func:`type_name`, :func:`type_hints`);
* :func:`check_choice`, :func:`check_at_least`, :func:`check_range`: a value among choices, above a bound, in a range;
* :func:`to_dataclass`: a Hydra section into one of the :mod:`pardec.config.schema` dataclasses (unknown keys and bad
  types refused, the dataclass's ``__post_init__`` checking the ranges with the helpers above).
"""

from __future__ import annotations

import enum
import inspect
import re
import types
import typing
from collections.abc import Callable
from dataclasses import fields
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A config value is out of range or of the wrong type."""


def key_name(section: str, key: str) -> str:
    """``section.key`` (``key`` alone for a top-level key, ``section`` empty)."""
    return f"{section}.{key}" if section else key


def is_int(value: Any) -> bool:
    """An integer that is not a bool (a parsed config's ``true`` is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_choice(key: str, value: Any, choices: tuple | list, *, or_null: bool = False) -> None:
    """``key={value!r} is not valid; choose one of: a, b`` unless ``value`` is one of ``choices`` (or None, with
    ``or_null``)."""
    if value in choices or (or_null and value is None):
        return
    raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(map(str, choices))}"
                      + (" or null" if or_null else ""))


def check_at_least(key: str, value: Any, low: float, *, integer: bool = False, or_null: bool = False) -> None:
    """``key={value!r} is out of range: it must be [an integer] >= low [or null]`` unless ``value`` is a number
    (an integer, with ``integer``) >= ``low`` (or None, with ``or_null``)."""
    if or_null and value is None:
        return
    if not (is_int(value) if integer else is_number(value)) or value < low:
        raise ConfigError(f"{key}={value!r} is out of range: it must be {'an integer ' if integer else ''}>= {low}"
                          + (" or null" if or_null else ""))


def check_range(key: str, value: Any, lo: float, hi: float, *, integer: bool = True, open_lo: bool = False) -> None:
    """``key={value!r} is out of range: it must be an integer in [lo, hi]`` (a number, without ``integer``;
    ``(lo, hi]`` with ``open_lo``) unless ``value`` is in it."""
    ok = (is_int(value) if integer else is_number(value)) and (lo < value if open_lo else lo <= value) and value <= hi
    if not ok:
        what = "an integer" if integer else "a number"
        raise ConfigError(f"{key}={value!r} is out of range: it must be {what} in {'(' if open_lo else '['}{lo}, {hi}]")


def fits_type(value: Any, tp: Any) -> bool:
    """Whether ``value`` (a parsed config scalar, list or dict) fits the annotation ``tp``: an int is a float, a
    bool is not an int, ``X | None`` takes null; element types of containers are not checked."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if tp is type(None) or tp is None:
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(fits_type(value, t) for t in typing.get_args(tp))
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return is_int(value)
    if tp is float:
        return is_number(value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):  # a config gives an enum by its value
        return isinstance(value, tp) or any(value == m.value for m in tp)
    cls = origin or tp
    return not isinstance(cls, type) or isinstance(value, cls)


def type_name(tp: Any) -> str:
    """``int``, ``int or null``, ``one of 'a', 'b'``: an annotation as the error names it."""
    if tp is type(None) or tp is None:
        return "null"
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(type_name(t) for t in typing.get_args(tp))
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    return getattr(tp, "__name__", str(tp))


def type_hints(obj: type | Callable) -> dict[str, Any]:
    """The annotations :func:`check_types` checks against: a class's fields (``typing.get_type_hints``), or a
    function's parameters, string ones evaluated in its module one at a time (one that cannot be, e.g. a name
    imported only for type checkers, is left out: that parameter goes unchecked)."""
    if isinstance(obj, type):
        return typing.get_type_hints(obj)
    out = {}
    for key, p in inspect.signature(obj).parameters.items():
        tp = p.annotation
        if isinstance(tp, str):
            try:
                tp = eval(tp, obj.__globals__)  # what typing.get_type_hints does, one parameter at a time
            except Exception:  # noqa: BLE001
                continue
        if tp is not inspect.Parameter.empty:
            out[key] = tp
    return out


def check_types(obj: type | Callable, values: dict[str, Any], where: str,
                explain: Callable[[str, Any], str] | None = None) -> None:
    """``values`` (name -> parsed config value; names that are no field / parameter are left to the caller) against
    the annotations of a dataclass's fields or a function's parameters (:func:`type_hints`): one line naming the
    first bad one (``trainer.learning_rate='abc' must be float``), followed by ``(explain(key, type))`` if given."""
    hints = type_hints(obj)
    for key, value in values.items():
        tp = hints.get(key)
        if tp is not None and not fits_type(value, tp):
            note = f" ({explain(key, tp)})" if explain else ""
            raise ConfigError(f"{key_name(where, key)}={value!r} must be {type_name(tp)}{note}")


D = TypeVar("D")


def to_dataclass(cls: type[D], section: DictConfig | dict | None, where: str) -> D:
    """Validate a config section against ``cls``; unknown keys and bad types raise :class:`ConfigError`, naming
    the key (``sampling.temperature='hot' must be float``)."""
    data = OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else dict(section or {})
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; valid keys: {', '.join(sorted(known))}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls), data)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = str(getattr(e, "full_key", None) or "")
        if key in data:  # a value of the wrong type: name the key, the value and the type wanted
            kind = str(known[key].type).replace(" | None", " or null")  # annotations are strings here
            if re.fullmatch(r"[\w.\[\]]+", where):  # a section: name its key with it
                raise ConfigError(f"{where}.{key}={data[key]!r} must be {kind}") from None
            raise ConfigError(f"{key}={data[key]!r} must be {kind} (in {where})") from None
        raise ConfigError(f"bad value in {where}: {e.msg if hasattr(e, 'msg') else e}") from None
