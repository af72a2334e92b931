"""The zoo: trained drafters pardec keeps in the repository (``zoo/<target>/<name>/``), so that every comparison starts
from the same artifacts instead of retraining them.

* the recipes: ``conf/zoo/<target>.yaml`` (:func:`entries`): per artifact, the training experiment and the overrides
  the zoo adds, what of the run's ``final/`` is kept and how it is stored (:mod:`pardec.zoo.store`), which method
  parameter reads it;
* an artifact: its stored files and ``manifest.json`` (:data:`FORMAT` / :data:`VERSION`): the command that made it,
  commit, host, torch, wall time per stage, training data (sources, counts, sha256 of the corpus), held-out metrics
  and the sha256 of every stored file;
* reading one: ``zoo:<name>`` wherever a path to a drafter, draft or model is taken (:func:`resolve`): the manifest and
  every hash checked, the target checked, and a directory the loaders read returned; anything missing, altered or
  made for another target or format is refused in one line naming ``make zoo``;
* ``python -m pardec.zoo list|build|verify`` (:mod:`pardec.zoo.__main__`; ``build``: :mod:`pardec.zoo.build`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pardec import CONF_DIR, REPO_ROOT
from pardec.config import ConfigError
from pardec.config.cli import hydra_errors_in_one_line
from pardec.jsonl import read_versioned

FORMAT = "pardec-zoo"
VERSION = 1
PREFIX = "zoo:"
ZOO_DIR = REPO_ROOT / "zoo"
DEFAULT_TARGET = "smollm2"
MANIFEST = "manifest.json"
STAGES = ("generate", "train", "eval")  # the stages of the draft and drafter kinds (an entry names others)


class ZooError(ConfigError):
    """A zoo artifact that cannot be used as asked: one line, naming the artifact and how to rebuild it."""


@dataclass
class Entry:
    """One artifact's recipe (an entry of ``conf/zoo/<target>.yaml``)."""

    name: str
    target: str  # the zoo's target: a model config name (conf/model/<target>.yaml)
    experiment: str
    overrides: list[str] = field(default_factory=list)
    keep: list[str] = field(default_factory=list)  # paths under the run's final/ that are stored
    store: dict = field(default_factory=dict)  # pardec.zoo.store: dtype / lowrank
    reads: dict = field(default_factory=dict)  # {method, key}: the method parameter that takes zoo:<name>
    stages: list[str] = field(default_factory=lambda: list(STAGES))  # the experiment kind's, in order
    run_root: str = "outputs/zoo"
    zoo: str = DEFAULT_TARGET  # the zoo's directory name under zoo/
    #: another entry of the same zoo whose trained run this one continues: its run's ``final/`` is this training's
    #: ``drafter.init_from`` (a drafter trained over several runs, each a recipe; the build runs the base first)
    base: str | None = None
    kept: bool = True  # False: a run that is only the base of another entry, never stored in the zoo
    #: keep the generate stage's corpus in the zoo too (pardec.zoo.corpus): one that takes several builds to write
    keep_corpus: bool = False

    @property
    def dir(self) -> Path:
        return ZOO_DIR / self.zoo / self.name

    @property
    def run_dir(self) -> Path:
        return REPO_ROOT / self.run_root / self.name

    def command(self, stage: str | None = None) -> list[str]:
        """``python -m train`` argv (after ``-m train``) for one stage of this recipe, in its run dir; training from
        a base starts from the base's run (``stage`` None: the whole recipe's command, with it)."""
        init = [f"+drafter.init_from={self.run_root}/{self.base}/final"] if self.base and stage in (None, "train") else []
        return [f"+experiment={self.experiment}", *self.overrides, *init, *([f"stage={stage}"] if stage else []),
                f"hydra.run.dir={self.run_root}/{self.name}"]  # relative: the build runs in the repository


def zoos() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "zoo").glob("*.yaml"))


def entries(zoo: str = DEFAULT_TARGET) -> dict[str, Entry]:
    """The recipes of ``conf/zoo/<zoo>.yaml`` by name."""
    path = CONF_DIR / "zoo" / f"{zoo}.yaml"
    if not path.is_file():
        raise ZooError(f"zoo {zoo!r} has no recipes (no {path}); zoos: {', '.join(zoos()) or 'none'}")
    raw = yaml.safe_load(path.read_text())
    keys = {"experiment", "overrides", "keep", "store", "reads", "stages", "base", "kept", "keep_corpus"}
    out = {}
    for name, e in (raw.get("artifacts") or {}).items():
        unknown = set(e) - keys
        if unknown:
            raise ZooError(f"{path}: artifact {name!r} has unknown key(s) {sorted(unknown)}; valid: {sorted(keys)}")
        out[name] = Entry(name=name, target=raw["target"], run_root=raw.get("run_root", "outputs/zoo"), zoo=zoo,
                          **{k: e[k] for k in keys if k in e})
    for e in out.values():
        if e.base is not None and (e.base not in out or e.base == e.name or out[e.base].experiment != e.experiment):
            raise ZooError(f"{path}: artifact {e.name!r} has base={e.base!r}: it must name another artifact of this "
                           f"zoo with the same experiment ({e.experiment}); artifacts: {', '.join(out)}")
    return out


def base_chain(entry: Entry) -> list[Entry]:
    """The entries ``entry`` continues, first trained first (empty: it trains from nothing)."""
    chain: list[Entry] = []
    known = entries(entry.zoo) if entry.base else {}
    e = entry
    while e.base is not None:
        e = known[e.base]
        if e in chain or e.name == entry.name:
            raise ZooError(f"conf/zoo/{entry.zoo}.yaml: artifact {entry.name!r}'s bases form a circle ({e.name})")
        chain.insert(0, e)
    return chain


def check_names(names: list[str], zoo: str = DEFAULT_TARGET) -> list[str]:
    known = entries(zoo)
    bad = [n for n in names if n not in known]
    if bad:
        raise ZooError(f"zoo {zoo!r} has no artifact {bad[0]!r}; artifacts: {', '.join(known)}")
    return names or list(known)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def stored_files(root: Path) -> dict[str, Path]:
    """Every file of an artifact directory but its manifest, by its path relative to it."""
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST}


def seal(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Write ``root/manifest.json``: ``manifest`` with the format, version and the sha256 and size of every file
    ``root`` holds (the manifest is written last: a directory without one is no artifact)."""
    m = {"format": FORMAT, "version": VERSION, **manifest,
         "files": {rel: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for rel, p in stored_files(root).items()}}
    tmp = root / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(m, indent=2) + "\n")
    tmp.replace(root / MANIFEST)
    return m


#: top-level keys of the composed training config that are not the recipe: where it runs and writes, which stage,
#: and what the run records without changing what it trains (``measure_memory``: the stages' peak memory)
NOT_RECIPE = ("hydra", "paths", "stage", "measure_memory")


def composed(entry: Entry):
    """The entry's training config as Hydra composes it: experiment + the zoo's overrides (a DictConfig)."""
    with hydra_errors_in_one_line(), initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=[f"+experiment={entry.experiment}", *entry.overrides])


def recipe_config(entry: Entry) -> dict[str, Any]:
    """The recipe as composed (:func:`composed`), interpolations left unresolved (so it does not depend on where the
    repository is), without :data:`NOT_RECIPE`."""
    plain = OmegaConf.to_container(composed(entry), resolve=False)
    for key in NOT_RECIPE:
        plain.pop(key, None)
    return plain


def recipe_hash(entry: Entry, training_only: bool = False) -> str:
    """sha256 of the recipe as composed (:func:`recipe_config`) and of what is kept and how it is stored: what an
    artifact's ``recipe.sha256`` must equal to match. ``training_only``: of the composed training config alone (a
    change of the stored form needs no retraining)."""
    plain = recipe_config(entry)
    what = {"config": plain} if training_only else {"config": plain, "keep": entry.keep, "store": entry.store}
    if entry.base is not None:  # a run that continues another: a change of the base's recipe makes this one stale
        what["base"] = recipe_hash(base_chain(entry)[-1], training_only=True)
    blob = json.dumps(what, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def read_manifest(name: str, zoo: str = DEFAULT_TARGET, key: str = "zoo") -> dict[str, Any]:
    d = ZOO_DIR / zoo / name
    f = d / MANIFEST
    hint = f"build it: make zoo ZOO_NAMES={name} (python -m pardec.zoo build {name})"
    if not f.is_file():
        known = sorted(p.parent.name for p in (ZOO_DIR / zoo).glob(f"*/{MANIFEST}"))
        where = f.relative_to(REPO_ROOT) if f.is_relative_to(REPO_ROOT) else f
        raise ZooError(f"{key}: {PREFIX}{name} is not in the zoo (no {where}; kept: "
                       f"{', '.join(known) or 'none'}); {hint}")

    return read_versioned(f, FORMAT, VERSION, ZooError, f"{key}: {PREFIX}{name}'s manifest", hint)


def verify(name: str, zoo: str = DEFAULT_TARGET, target: str | None = None, key: str = "zoo") -> dict[str, Any]:
    """The manifest of artifact ``name`` after checking that its files are exactly the ones it lists, each with its
    sha256, and (``target``) that it was made for that model; else one :class:`ZooError` line."""
    m = read_manifest(name, zoo, key)
    hint = f"rebuild it: make zoo ZOO_NAMES={name} (python -m pardec.zoo build {name})"
    if target is not None and m.get("target", {}).get("name") != target:
        raise ZooError(f"{key}: {PREFIX}{name} was trained for {m.get('target', {}).get('name')!r}; this run's model is "
                       f"{target!r} (zoo {zoo!r} holds drafters of {m.get('target', {}).get('name')!r} only)")
    root = ZOO_DIR / zoo / name
    have = stored_files(root)
    listed = m.get("files", {})
    for rel, info in listed.items():
        if rel not in have:
            raise ZooError(f"{key}: {PREFIX}{name} lacks {rel} (listed in its manifest); {hint}")
        if have[rel].stat().st_size != info["bytes"] or sha256_file(have[rel]) != info["sha256"]:
            raise ZooError(f"{key}: {PREFIX}{name}'s {rel} does not match the sha256 in its manifest (altered or "
                           f"partly written); {hint}")
    extra = sorted(set(have) - set(listed))
    if extra:
        raise ZooError(f"{key}: {PREFIX}{name} holds file(s) its manifest does not list ({', '.join(extra)}); {hint}")
    return m


def is_ref(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def locate(value: str, key: str) -> tuple[str, str]:
    """``zoo:<name>`` or ``zoo:<zoo>/<name>`` -> (zoo, name); one line for a reference that names no zoo there is."""
    zoo, _, name = value[len(PREFIX):].rpartition("/")
    zoo = zoo or DEFAULT_TARGET
    if not name or zoo not in zoos():
        raise ZooError(f"{key}={value!r} is not a zoo artifact: write {PREFIX}<name> (zoos: {', '.join(zoos())})")
    return zoo, name


def resolve(value: Any, key: str, target: str | None = None) -> Any:
    """``zoo:<name>`` (or ``zoo:<zoo>/<name>``) -> the directory a loader reads, after :func:`verify`; any other
    value unchanged. Artifacts stored in a reduced form are rebuilt once into ``data/zoo/`` (:mod:`pardec.zoo.store`);
    ``target``: the run's model config name, which the artifact must have been made for."""
    if not is_ref(value):
        return value
    zoo, name = locate(value, key)
    m = verify(name, zoo, target, key)
    from pardec.zoo.store import materialize  # heavy: torch

    return str(materialize(ZOO_DIR / zoo / name, m))
