"""One registry type for methods, tasks, models and metrics: aliases, duplicate checks, helpful errors."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """An unknown registry key; the message names the bad value and the valid choices."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain sentence
        return str(self.args[0])


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}
        self._aliases: dict[str, str] = {}
        self._renamed: dict[str, str] = {}  # a name of an earlier release -> its name now (refused, naming it)

    def register(self, name: str, *, aliases: tuple[str, ...] = (), renamed_from: tuple[str, ...] = ()
                 ) -> Callable[[T], T]:
        """``aliases``: other names that reach it; ``renamed_from``: its names in earlier releases, refused in one
        line naming the new one."""
        def deco(obj: T) -> T:
            self.add(name, obj, aliases=aliases, renamed_from=renamed_from)
            return obj

        return deco

    def add(self, name: str, obj: T, *, aliases: tuple[str, ...] = (), renamed_from: tuple[str, ...] = ()) -> None:
        for key in (name, *aliases, *renamed_from):
            if key in self._items or key in self._aliases or key in self._renamed:
                raise ValueError(f"{self.kind} {key!r} is registered twice")
        self._items[name] = obj
        for alias in aliases:
            self._aliases[alias] = name
        for old in renamed_from:
            self._renamed[old] = name

    def canonical(self, name: str) -> str:
        if name in self._items:
            return name
        if name in self._aliases:
            return self._aliases[name]
        if name in self._renamed:
            raise UnknownNameError(f"{self.kind} {name!r} is now named {self._renamed[name]!r}")
        choices = sorted(self._items)
        close = difflib.get_close_matches(str(name), choices + sorted(self._aliases), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownNameError(f"unknown {self.kind} {name!r}.{hint} Valid {self.kind}s: {', '.join(choices)}")

    def get(self, name: str) -> T:
        return self._items[self.canonical(name)]

    def current(self, name: str) -> str:
        """``name``, or its name now when it is a name of an earlier release (records written before a rename)."""
        return self._renamed.get(name, name)

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
