"""``python_docstrings``: offline code prompts built from the Python standard library; no metric.

Each prompt asks for a function given its signature and docstring: the public, documented, pure-Python
functions of a fixed list of standard-library modules (``inspect``; deterministic order: module list order, then
name). A few hundred prompts, no download: code-prompt training data for distillation when no code corpus is
available offline (HumanEval stays held out for evaluation). The set depends on the Python version.

``dataset.extra``: ``modules`` (list of module names; default :data:`MODULES`), ``min_doc_chars`` (shorter
docstrings are skipped; default 60), ``max_doc_chars`` (docstrings are cut to this; default 600), ``members``
(``functions``: module-level functions, the default, ~520 prompts on Python 3.12; ``methods``: the public methods
of the modules' public classes, ~600 more, "write the method ``Class.name(self, ...)``"; a second source of
the same task with ``members: methods`` grows a code corpus without repeating a prompt).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from pardec.config import ConfigError, DatasetConfig
from pardec.tasks.base import Task, chat_ids, register_task, text_ids

MODULES = ("string", "textwrap", "json", "re", "os.path", "posixpath", "shutil", "glob", "fnmatch", "random",
           "statistics", "bisect", "heapq", "functools", "itertools", "operator", "copy", "base64", "binascii",
           "calendar", "datetime", "colorsys", "difflib", "html", "urllib.parse", "ipaddress", "csv", "gzip",
           "zipfile", "tarfile", "tempfile", "email.utils", "http.cookiejar", "inspect", "ast", "tokenize",
           "dis", "pprint", "reprlib", "locale", "gettext", "argparse", "logging", "subprocess", "shlex",
           "platform", "sysconfig", "uuid", "hashlib", "hmac", "secrets", "fractions", "decimal", "numbers",
           "contextlib", "dataclasses", "enum", "typing", "weakref", "types", "warnings", "traceback",
           "linecache", "codecs", "unicodedata", "quopri", "mimetypes", "pathlib", "configparser", "sched",
           "queue", "threading", "socket", "ssl", "selectors", "smtplib", "imaplib", "ftplib", "wave",
           "sqlite3", "pickle", "shelve", "zlib", "bz2", "lzma", "graphlib", "pkgutil", "importlib.util",
           "unittest.mock", "doctest", "timeit", "cProfile", "pstats", "tracemalloc", "xml.dom.minidom",
           "xml.etree.ElementTree", "wsgiref.util", "http.server", "urllib.request", "webbrowser", "filecmp",
           "stat", "tabnanny", "keyword", "token", "symtable", "code", "codeop", "cmd", "optparse", "getopt")
EXTRA_KEYS = ("modules", "min_doc_chars", "max_doc_chars", "members")
MEMBERS = ("functions", "methods")
REQUEST = "Write a Python {what} `{name}{sig}` that does the following:\n\n{doc}"


@register_task("python_docstrings", aliases=("stdlib_docstrings",))
class PythonDocstrings(Task):
    metric = "none"

    def __init__(self, cfg: DatasetConfig, timeout_s: float = 10.0):
        super().__init__(cfg, timeout_s)
        unknown = sorted(set(cfg.extra) - set(EXTRA_KEYS))
        if unknown:
            raise ConfigError(f"unknown dataset.extra key(s) {unknown} for python_docstrings; valid: "
                              f"{', '.join(EXTRA_KEYS)}")
        self.modules = list(cfg.extra.get("modules") or MODULES)
        self.min_chars = int(cfg.extra.get("min_doc_chars", 60))
        self.max_chars = int(cfg.extra.get("max_doc_chars", 600))
        self.members = cfg.extra.get("members", "functions")
        if self.members not in MEMBERS:
            raise ConfigError(f"dataset.extra.members={self.members!r} is not valid for python_docstrings; choose "
                              f"one of: {', '.join(MEMBERS)}")

    def _members(self, mod) -> list[tuple[str, str, object]]:
        """(qualified name, short name, function) of the public functions or methods of ``mod``, sorted."""
        if self.members == "functions":
            return [(name, name, fn) for name, fn in sorted(inspect.getmembers(mod, inspect.isfunction))
                    if fn.__module__ == mod.__name__]
        out = []
        for cname, cls in sorted(inspect.getmembers(mod, inspect.isclass)):
            if cname.startswith("_") or cls.__module__ != mod.__name__:
                continue
            out += [(f"{cname}.{name}", name, fn) for name, fn in sorted(vars(cls).items()) if inspect.isfunction(fn)]
        return out

    def docs(self) -> list[dict]:
        """``{"id": "<module>.<function>", "name", "signature", "doc"}`` per documented public function."""
        out, seen = [], set()
        for mod_name in self.modules:
            try:
                mod = importlib.import_module(mod_name)
            except ImportError:  # a module missing from this Python build
                continue
            for qual, name, fn in self._members(mod):
                doc = inspect.getdoc(fn) or ""
                if name.startswith("_") or len(doc) < self.min_chars:
                    continue
                key = f"{fn.__module__}.{fn.__qualname__}"
                if key in seen:  # os.path is posixpath
                    continue
                seen.add(key)
                try:
                    sig = str(inspect.signature(fn))
                except (TypeError, ValueError):
                    continue
                out.append({"id": key, "name": name, "qualname": qual, "signature": sig,
                            "doc": doc[: self.max_chars].strip()})
        return out

    def prompt_ids(self, doc: dict, tokenizer, chat: bool, history: list[str] = ()) -> list[int]:
        qual = doc.get("qualname", doc["name"])
        method = qual != doc["name"]
        if chat:
            request = REQUEST.format(what="method" if method else "function", name=qual, sig=doc["signature"],
                                     doc=doc["doc"])
            return chat_ids(tokenizer, [{"role": "user", "content": request}])
        if not method:
            body = "\n    ".join(doc["doc"].splitlines())
            return text_ids(tokenizer, f'def {doc["name"]}{doc["signature"]}:\n    """{body}\n    """\n')
        body = "\n        ".join(doc["doc"].splitlines())
        cls = qual.rsplit(".", 1)[0]
        return text_ids(tokenizer, f'class {cls}:\n    def {doc["name"]}{doc["signature"]}:\n        """{body}\n        """\n')

    def stop_strings(self, chat: bool) -> list[str]:
        return [] if chat else ["\ndef ", "\nclass "]

    def score(self, doc: dict, completions: list[str]) -> dict[str, Any]:
        return {}
