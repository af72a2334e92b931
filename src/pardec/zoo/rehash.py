"""``python -m pardec.zoo rehash --at <commit> [names]``: carry kept artifacts over a change that renames config keys
but trains the same thing (a section or a kind renamed), without retraining, and only where that is shown:

1. at ``<commit>`` (a temporary git worktree: that commit's own code and configs) the artifact's recipe hash equals
   its manifest's ``recipe.sha256``, so the config composed there is the one it was built from;
2. that config, with the renames pardec refuses the old spellings by (sections: ``pardec.config.cli.OLD_KEYS``; the
   ``kind`` value: ``pardec.config.cli.RENAMED_OPTIONS``) and without :data:`~pardec.zoo.NOT_RECIPE`, equals
   today's key for key, and so do what is kept and how it is stored (for each run it continues too);
3. then the manifest's ``recipe`` (and its bases') takes today's overrides and hash, and ``recipe.rehashed``
   records the commit, the old hash and the renames applied.

Anything else is refused in one line naming the keys that differ: that artifact is stale, and ``build`` retrains it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pardec import REPO_ROOT
from pardec.config.cli import OLD_KEYS, RENAMED_OPTIONS
from pardec.zoo import MANIFEST, NOT_RECIPE, Entry, ZooError, base_chain, recipe_config, recipe_hash

#: what runs at the old commit (its own pardec): every artifact's hash and composed config, as that code made them
_DUMP = """
import json, sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from pardec import CONF_DIR, zoo
import pardec.train  # (its resolvers)
out = {}
for name, e in zoo.entries(sys.argv[1]).items():
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"+experiment={e.experiment}", *e.overrides])
    out[name] = {"hash": zoo.recipe_hash(e), "config": OmegaConf.to_container(cfg, resolve=False),
                 "keep": e.keep, "store": e.store}
print(json.dumps(out, default=str))
"""


def recipes_at(commit: str, zoo: str) -> dict[str, dict[str, Any]]:
    """Every artifact's ``{hash, config, keep, store}`` as the code and configs of ``commit`` compose them."""
    with tempfile.TemporaryDirectory(prefix="pardec-rehash-") as tmp:
        tree = Path(tmp) / "tree"
        add = subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=REPO_ROOT,
                             capture_output=True, text=True)
        if add.returncode:
            raise ZooError(f"--at {commit}: no such commit here ({add.stderr.strip().splitlines()[-1]})")
        try:
            run = subprocess.run([sys.executable, "-c", _DUMP, zoo], cwd=tree, capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": str(tree / "src")})
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO_ROOT, capture_output=True)
        if run.returncode:
            raise ZooError(f"--at {commit}: its zoo could not be composed ({run.stderr.strip().splitlines()[-1]})")
        return json.loads(run.stdout)


def renamed(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``config`` (a composed training config) in today's spellings: a section of an earlier name moved to its new
    one, an earlier kind's name replaced; without :data:`NOT_RECIPE`. Returns it and the renames applied."""
    out, applied = dict(config), []
    for key in NOT_RECIPE:
        out.pop(key, None)
    for old, new in OLD_KEYS.items():
        if "." not in old and "." not in new and old in out and new not in out:
            out[new] = out.pop(old)
            applied.append(f"{old}: -> {new}:")
    kind = out.get("kind")
    if isinstance(kind, str) and f"kind/{kind}" in RENAMED_OPTIONS:
        out["kind"] = RENAMED_OPTIONS[f"kind/{kind}"]
        applied.append(f"kind {kind} -> {out['kind']}")
    return out, applied


def differences(old: Any, new: Any, where: str = "") -> list[str]:
    """The dotted keys at which two composed configs differ, each with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new), key=str)
                for d in differences(old.get(k, "<absent>"), new.get(k, "<absent>"), f"{where}.{k}" if where else str(k))]
    return [] if old == new else [f"{where or '(root)'}: {old!r} -> {new!r}"]


def check(entry: Entry, at: dict[str, dict[str, Any]], manifest: dict[str, Any]) -> list[str]:
    """The renames that carry ``entry`` (and every run it continues) from ``at`` to today; a :class:`ZooError`
    naming what differs where the recipe is not the same."""
    old = at.get(entry.name)
    if old is None:
        raise ZooError(f"{entry.name}: no such artifact at that commit")
    if old["hash"] != manifest["recipe"]["sha256"]:
        raise ZooError(f"{entry.name}: its recipe at that commit is not the one it was built from (hash "
                       f"{old['hash'][:12]}, manifest {manifest['recipe']['sha256'][:12]}); give a commit where "
                       f"it matched")
    applied: list[str] = []
    for run in [entry, *base_chain(entry)]:
        before = at.get(run.name)
        if before is None:
            raise ZooError(f"{entry.name}: its base {run.name!r} is no artifact at that commit")
        then, renames = renamed(before["config"])
        diff = differences(then, recipe_config(run))
        diff += [f"{what}: {before[what]!r} -> {getattr(run, what)!r}" for what in ("keep", "store")
                 if run is entry and before[what] != getattr(run, what)]
        if diff:
            raise ZooError(f"{entry.name}: {'' if run is entry else f'its base {run.name}: '}the recipe changed, not "
                           f"only its spelling: {'; '.join(diff[:6])}{' ...' if len(diff) > 6 else ''}; "
                           f"`python -m pardec.zoo build {entry.name}` retrains it")
        applied += [r for r in renames if r not in applied]
    return applied


def rehash(entry: Entry, at: dict[str, dict[str, Any]], commit: str) -> str:
    """Carry ``entry``'s manifest over (module docstring); returns a line saying what was done."""
    path = entry.dir / MANIFEST
    m = json.loads(path.read_text())
    applied = check(entry, at, m)
    new = recipe_hash(entry)
    if new == m["recipe"]["sha256"]:
        return f"{entry.name}: already today's recipe"
    record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "at": commit,
              "sha256": m["recipe"]["sha256"], "overrides": m["recipe"].get("overrides"), "renames": applied}
    m["recipe"].update(overrides=entry.overrides, sha256=new,
                       rehashed=[*m["recipe"].get("rehashed", []), record])
    by_name = {b.name: b for b in base_chain(entry)}
    for b in m.get("bases", []):
        if b.get("name") in by_name:
            b["recipe"].update(overrides=by_name[b["name"]].overrides,
                               sha256=recipe_hash(by_name[b["name"]], training_only=True))
    tmp = path.with_name(f"{MANIFEST}.tmp")
    tmp.write_text(json.dumps(m, indent=2) + "\n")
    tmp.replace(path)
    return f"{entry.name}: rehashed ({', '.join(applied) or 'no renames'}; the recipe of {commit[:12]} otherwise)"
