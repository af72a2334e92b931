"""``python -m pardec.zoo build [names]``: (re)train each missing or stale artifact with its recipe and store it.

A build runs the recipe's stages one ``python -m train ... stage=<s>`` at a time in ``<run_root>/<name>`` (timed; the
other processes' load on the machine recorded beside each time), resumable: a stage that finished under the same
recipe is not run again (``zoo_stages.json`` in the run dir), a killed training resumes from its newest complete
checkpoint. Then the kept files are stored (:func:`pardec.zoo.store.pack`); when the stored form is not the trained
one (a low-rank delta, bf16), the recipe's evaluation is run once more on the stored form, and the manifest holds
both. The artifact directory is replaced in one rename, manifest last written, so a kill leaves the old one or none.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from pardec import REPO_ROOT
from pardec.zoo import (
    MANIFEST,
    ZOO_DIR,
    Entry,
    ZooError,
    base_chain,
    corpus,
    recipe_hash,
    seal,
    sha256_file,
    verify,
)
from pardec.zoo.store import TARGET_FORMS, check_store, materialize, pack

STAGES_FILE = "zoo_stages.json"
SEEDED_FILE = "zoo_seeded.json"  # a base run made of a kept artifact: the records of the runs it holds


def status(entry: Entry, recipe: str | None = None) -> str:
    """``missing`` | ``altered`` (files differ from the manifest) | ``stale`` (its recipe changed) | ``ok`` |
    ``not kept`` (a base of other entries only)."""
    if not entry.kept:
        return "not kept"
    if not (entry.dir / MANIFEST).is_file():
        return "missing"
    try:
        m = verify(entry.name, entry.zoo)
    except ZooError:
        return "altered"
    return "ok" if m["recipe"]["sha256"] == (recipe or recipe_hash(entry)) else "stale"


#: seconds between two records of a running stage's elapsed time (what a killed stage had run is kept)
HEARTBEAT_S = 30.0


def run_stage(entry: Entry, stage: str, argv: list[str], log, beat=None) -> dict[str, Any]:
    """Run one stage as its own process (its progress bars on this terminal); its wall time and the machine's load.
    ``beat(seconds)``: called with the elapsed time every :data:`HEARTBEAT_S` while it runs."""
    cmd = [sys.executable, "-m", "train", *argv]
    log(f"[zoo] {entry.name}: stage {stage}: {shlex.join(cmd[1:])}")
    load_before, git_at_start = os.getloadavg()[0], git_state()  # the code the stage runs
    t0, started = time.perf_counter(), datetime.now(timezone.utc).isoformat(timespec="seconds")
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    while True:
        try:
            returncode = proc.wait(timeout=HEARTBEAT_S)
            break
        except subprocess.TimeoutExpired:
            if beat is not None:
                beat(round(time.perf_counter() - t0, 1))
    if returncode != 0:
        raise ZooError(f"building {entry.name}: stage {stage} exited with status {returncode}; rerun "
                       f"`python -m pardec.zoo build {entry.name}` to resume")
    return {"wall_s": round(time.perf_counter() - t0, 1), "started": started, "load_1m_before": round(load_before, 2),
            "load_15m_after": round(os.getloadavg()[2], 2), "argv": argv, **git_at_start}


def train_argv(entry: Entry, stage: str, run_dir: Path) -> list[str]:
    """A stage's argv; a training killed after a checkpoint resumes from the newest complete one (training checks
    which that is, and skips one cut short mid-save)."""
    argv = entry.command(stage)
    if stage == "train" and any((c / "trainer_state.json").is_file() for c in run_dir.glob("checkpoint-*")):
        argv.append("trainer.resume_from_checkpoint=true")
    return argv


def run_stages(entry: Entry, recipe: str, log) -> dict[str, dict]:
    """Every stage of the recipe not yet run under the same training config (``recipe``: its hash). A run dir left
    by another recipe (or by none recorded) is cleared first, so that its checkpoints are not resumed."""
    run_dir = entry.run_dir
    path = run_dir / STAGES_FILE
    done = json.loads(path.read_text()) if path.is_file() else {}
    if done.get("recipe_sha256") != recipe:
        if run_dir.is_dir() and any(run_dir.iterdir()):  # another recipe's run: its checkpoints must not be resumed
            log(f"[zoo] {entry.name}: {run_dir} holds a run of another recipe; cleared")
            shutil.rmtree(run_dir)
        done = {"recipe_sha256": recipe, "stages": {}}
    run_dir.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(done, indent=2) + "\n")
        tmp.replace(path)

    for stage in entry.stages:
        if stage in done["stages"]:
            log(f"[zoo] {entry.name}: stage {stage} done earlier ({done['stages'][stage]['wall_s']} s)")
            continue
        # a process of this stage that was killed: its time counts (a resumed training continues its work)
        earlier = [r for r in done.get("killed", []) if r["stage"] == stage]
        running = {"stage": stage, "wall_s": 0.0, "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        done.setdefault("killed", []).append(running)  # what is left of it if this process is killed too

        def beat(seconds: float, running=running) -> None:
            running["wall_s"] = seconds
            save()

        kept = stage == "generate" and entry.keep_corpus
        if kept:  # the corpus written by earlier builds, kept in the zoo: only the rest is generated
            out_dir = corpus.out_dir_of(entry)
            corpus.restore(corpus.kept_dir(entry, out_dir), out_dir, log)
        result = run_stage(entry, stage, train_argv(entry, stage, run_dir), log, beat)
        if kept:
            corpus.keep(out_dir, corpus.kept_dir(entry, out_dir), log)
        done["killed"].remove(running)
        if earlier:
            result = {**result, "wall_s": round(result["wall_s"] + sum(r["wall_s"] for r in earlier), 1),
                      "processes": [*earlier, {"started": result["started"], "wall_s": result["wall_s"]}]}
            done["killed"] = [r for r in done["killed"] if r["stage"] != stage]
        done["stages"][stage] = result
        save()
    return done["stages"]


def eval_stored(entry: Entry, stored: Path, manifest: dict, log) -> dict[str, Any]:
    """The recipe's evaluation of the stored form (rebuilt as the loaders see it) in ``<run dir>-stored``."""
    run_dir = entry.run_dir.with_name(entry.run_dir.name + "-stored")
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir).mkdir(parents=True)
    shutil.copytree(materialize(stored, manifest), run_dir / "final", ignore=shutil.ignore_patterns("trees", ".*"))
    argv = [a for a in entry.command("eval") if not a.startswith("hydra.run.dir=")]
    argv.append(f"hydra.run.dir={run_dir.relative_to(REPO_ROOT)}")
    timing = run_stage(entry, "eval (stored form)", argv, log)
    return {"wall_s": timing["wall_s"], "metrics": eval_metrics(run_dir)}


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def host() -> dict[str, Any]:
    from pardec.models.host import cpu_flags, cpu_model  # heavy: transformers

    return {"cpu": cpu_model(), "flags": cpu_flags(), "cores": os.cpu_count(), "torch": torch.__version__,
            "python": sys.version.split()[0]}


def data_section(run_dir: Path) -> dict[str, Any]:
    """The training corpus and held-out sets the run read: sources, counts and the sha256 of each merged file."""
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")  # the composed config of the last stage run
    OmegaConf.update(cfg, "paths.root_dir", str(REPO_ROOT), force_add=True)
    # outside the Hydra app, what conf/train.yaml reads from Hydra's runtime (${hydra:runtime.choices.experiment})
    # comes from the run's own .hydra/hydra.yaml
    choices = OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra.runtime.choices
    OmegaConf.update(cfg, "experiment_name", choices.get("experiment"), force_add=True)

    def corpus(out_dir: Path, sources: list, merged_name: str = "completions.jsonl") -> dict[str, Any]:
        merged = out_dir / merged_name
        stats = json.loads((out_dir / "stats.json").read_text()) if (out_dir / "stats.json").is_file() else {}
        return {"sources": sources,
                "dir": str(out_dir.relative_to(REPO_ROOT)) if out_dir.is_relative_to(REPO_ROOT) else str(out_dir),
                "records": sum(1 for _ in merged.open()) if merged.is_file() else None,
                "sha256": sha256_file(merged) if merged.is_file() else None, "stats": stats}

    def plain(node) -> Any:
        return OmegaConf.to_container(node, resolve=True)

    out: dict[str, Any] = {}
    if "completions" in cfg:  # the draft and drafter kinds: the target's completions (CLLM: its AR answers)
        out["train"] = corpus(Path(cfg.completions.out_dir), plain(cfg.completions.sources))
    if "collect" in cfg:  # CLLM: the Jacobi trajectories collected from the same prompts (its consistency rows)
        out["trajectories"] = corpus(Path(cfg.collect.out_dir), [{"dataset": plain(cfg.dataset),
                                                                  "max_prompts": cfg.collect.max_prompts}],
                                     "trajectories.jsonl")
    elif "mask" in cfg:  # SDSAT: the masked corpus made of its sources
        out["train"] = corpus(Path(cfg.mask.out_dir), plain(cfg.mask.sources), "masked.jsonl")
    if "eval" in cfg and "sources" in cfg.eval:
        out["heldout"] = {}
        for src in plain(cfg.eval.sources):
            if "completions" in src:  # a completions directory the eval reads as it is (SDSAT)
                d = Path(src["completions"])
                out["heldout"][d.name] = corpus(d, [src])
            elif "out_dir" in cfg.eval:  # the eval's own completions of a dataset, one directory per dataset
                d = Path(cfg.eval.out_dir) / src["dataset"]["name"]
                out["heldout"][src["dataset"]["name"]] = corpus(d, [src])
            elif "max_docs" in src:  # human text read from a dataset (SDSAT's reference answers)
                out["heldout"][f"{src['dataset']['name']}_reference"] = {"sources": [src]}
            else:  # a dataset's prompts the eval decodes itself (CLLM's Jacobi decoding): its records are the eval's
                out["heldout"][src["dataset"]["name"]] = {"sources": [src]}
    return out


def compact(value: Any, depth: int = 0) -> Any:
    """The figures of an evaluation file small enough for a manifest: numbers, short lists of numbers (by depth or
    draft position), and dicts of them, two levels down; long per-record arrays left out (the run dir keeps them)."""
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, list):  # by depth or position; by depth, then rank (Medusa / FIRP top-k accuracy)
        short = len(value) <= 16 and all(isinstance(v, (int, float)) or (isinstance(v, list) and len(v) <= 16 and all(
            isinstance(x, (int, float)) for x in v)) for v in value)
        return value if short else None
    if isinstance(value, dict) and depth < 3:
        out = {k: compact(v, depth + 1) for k, v in value.items()}
        return {k: v for k, v in out.items() if v is not None and v != {}}
    return None


def eval_metrics(run_dir: Path) -> dict[str, Any] | None:
    """The recipe's held-out figures: its summary's ``eval`` section, and per held-out set what its evaluation file
    (``drafter_eval.json``, ``draft_eval.json``, ``cllm_eval.json``; SDSAT's ``sdsat_eval.json``: overall and per
    source) holds."""
    summary = json.loads((run_dir / "train_summary.json").read_text()).get("eval")
    f = next((run_dir / n for n in ("drafter_eval.json", "draft_eval.json", "cllm_eval.json")
              if (run_dir / n).is_file()), None)
    if summary is not None and f is not None:
        per = json.loads(f.read_text()).get("per_dataset") or {}
        summary = {**summary, "per_dataset": compact(per)}
    elif summary is not None and (run_dir / "sdsat_eval.json").is_file():  # SDSAT: its eval file holds the figures
        full = json.loads((run_dir / "sdsat_eval.json").read_text())  # against the model's own greedy tokens, the
        summary = {**summary, "overall": compact(full["overall"]),   # ones decoding accepts, and per source
                   "per_dataset": compact(full["per_source"])}
    return summary


def base_record(base: Entry, stages: dict, data: Any, metrics: Any) -> dict[str, Any]:
    """What a manifest's ``bases`` keeps of one run the artifact continues."""
    return {"name": base.name, "recipe": {"experiment": base.experiment, "overrides": base.overrides,
                                          "sha256": recipe_hash(base, training_only=True)},
            "command": shlex.join(["python", "-m", "train", *base.command()]), "stages": stages, "data": data,
            "metrics": metrics}


def stored_run(base: Entry) -> tuple[str, dict[str, Any]] | None:
    """A kept artifact of the zoo built from exactly ``base``'s recipe (its manifest's ``recipe.sha256``: the same
    composed config, runs it continues, kept files and stored form), whatever its name, if its files verify."""
    want = recipe_hash(base)
    for f in sorted((ZOO_DIR / base.zoo).glob(f"*/{MANIFEST}")):
        m = json.loads(f.read_text())
        if m.get("recipe", {}).get("sha256") == want:
            try:
                return f.parent.name, verify(f.parent.name, base.zoo)
            except ZooError:  # altered files: not a run to continue
                continue
    return None


def seed_run(base: Entry, name: str, m: dict[str, Any]) -> list[dict[str, Any]]:
    """``base``'s run made of the kept artifact ``name`` (manifest ``m``, built from ``base``'s recipe): its stored
    form (as loaders read it) becomes ``<base run>/final`` and every stage of the base counts as done (a later build
    resumes from it), so a continuation trains without retraining its bases. Returns the records of the runs it
    holds, first trained first: the artifact's own ``bases`` and itself, with where it came from."""
    stages = {s: {**m.get("stages", {}).get(s, {}), "seeded_from": f"zoo/{base.zoo}/{name}"} for s in base.stages}
    shutil.rmtree(base.run_dir, ignore_errors=True)
    base.run_dir.mkdir(parents=True)
    shutil.copytree(materialize(ZOO_DIR / base.zoo / name, m), base.run_dir / "final",
                    ignore=shutil.ignore_patterns(MANIFEST, ".*"))
    (base.run_dir / STAGES_FILE).write_text(json.dumps(
        {"recipe_sha256": recipe_hash(base, training_only=True), "stages": stages}, indent=2) + "\n")
    record = {**base_record(base, m.get("stages", {}), m.get("data"), m.get("metrics")),
              "seeded_from": {"artifact": f"zoo/{base.zoo}/{name}", "date": m.get("date"), "commit": m.get("commit"),
                              "host": (m.get("host") or {}).get("cpu"), "store": m.get("store"),
                              "metrics_stored": m.get("metrics_stored")}}
    records = [*m.get("bases", []), record]
    (base.run_dir / SEEDED_FILE).write_text(json.dumps(records, indent=2) + "\n")  # written last: the seed is whole
    return records


def seeded_records(base: Entry) -> list[dict[str, Any]] | None:
    """The records :func:`seed_run` left in ``base``'s run dir, if that run was seeded under its current recipe."""
    stages, records = base.run_dir / STAGES_FILE, base.run_dir / SEEDED_FILE
    if not records.is_file() or not stages.is_file():
        return None
    if json.loads(stages.read_text()).get("recipe_sha256") != recipe_hash(base, training_only=True):
        return None
    return json.loads(records.read_text())


def build_one(entry: Entry, force: bool = False, log=print) -> dict[str, Any] | None:
    """Build ``entry`` unless it is already stored from its current recipe (``force``: anyway); returns the new
    manifest (None when nothing was built)."""
    check_store(entry.store, f"conf/zoo/{entry.zoo}.yaml artifact {entry.name}")
    if not entry.kept:  # a base only: its run is trained (resumable) for the entries that continue it
        log(f"[zoo] {entry.name}: not kept in the zoo; its run is the base of another artifact")
        run_stages(entry, recipe_hash(entry, training_only=True), log)
        return None
    recipe = recipe_hash(entry)
    state = status(entry, recipe)
    if state == "ok" and not force:
        log(f"[zoo] {entry.name}: up to date")
        return None
    log(f"[zoo] {entry.name}: {state}; building")
    bases, chain = [], base_chain(entry)
    for i in reversed(range(len(chain))):  # a base made of a kept artifact: the runs up to it are not trained again
        if (records := seeded_records(chain[i])) is not None:
            log(f"[zoo] {entry.name}: {chain[i].name}'s run is {records[-1]['seeded_from']['artifact']}'s stored form")
        elif (found := stored_run(chain[i])) is not None:
            log(f"[zoo] {entry.name}: continues {chain[i].name}, kept in the zoo as {found[0]} (its stored form)")
            records = seed_run(chain[i], *found)
        if records is not None:
            bases, chain = records, chain[i + 1:]
            break
    for base in chain:  # the runs it continues, first trained first, each resumable like its own
        log(f"[zoo] {entry.name}: continues {base.name}")
        base_stages = run_stages(base, recipe_hash(base, training_only=True), log)
        bases.append(base_record(base, base_stages, data_section(base.run_dir), eval_metrics(base.run_dir)))
    stages = run_stages(entry, recipe_hash(entry, training_only=True), log)
    final = entry.run_dir / "final"
    from pardec.models.loading import named_config  # heavy: transformers

    target_cfg = named_config(entry.target)
    for stale in entry.dir.parent.glob(f".{entry.name}.tmp-*"):  # left by a build that stopped while packing
        shutil.rmtree(stale, ignore_errors=True)
    tmp = entry.dir.with_name(f".{entry.name}.tmp-{os.getpid()}")
    try:
        return _store(entry, recipe, stages, final, target_cfg, tmp, log, bases)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _store(entry, recipe: str, stages: dict, final: Path, target_cfg, tmp: Path, log,
           bases: list[dict] | None = None) -> dict[str, Any]:
    """Pack ``final`` into ``tmp``, seal its manifest, evaluate the stored form, then swap it in for the entry.
    ``bases``: the runs it continues (their commands, stages, data and held-out figures), first trained first."""
    from pardec.models.loading import weights_location  # heavy: transformers

    store = pack(final, tmp, entry.keep, entry.store,
                 Path(weights_location(target_cfg)) if set(TARGET_FORMS) & set(entry.store) else None)
    drafter = json.loads((final / "drafter.json").read_text()) if (final / "drafter.json").is_file() else {}
    manifest: dict[str, Any] = {
        "name": entry.name,
        "target": {"name": entry.target, "source": target_cfg.source, "path": target_cfg.path,
                   "file": getattr(target_cfg, "gguf_file", None)},
        "artifact": {k: drafter.get(k) for k in ("format", "version", "kind", "parameters")} if drafter else {},
        "reads": entry.reads,
        "recipe": {"experiment": entry.experiment, "overrides": entry.overrides, "sha256": recipe},
        "command": shlex.join(["python", "-m", "train", *entry.command()]),
        **git_state(), **{k: stages["train"][k] for k in ("commit", "dirty") if k in stages.get("train", {})},
        "host": host(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "stages": stages, "data": data_section(entry.run_dir), "metrics": eval_metrics(entry.run_dir),
        "store": store, **({"bases": bases} if bases else {}),
    }
    manifest = seal(tmp, manifest)
    if entry.store:  # the mechanism numbers of what is stored, beside the trained form's
        manifest = seal(tmp, {**manifest, "metrics_stored": eval_stored(entry, tmp, manifest, log)})
    old = entry.dir.with_name(f".{entry.name}.old-{os.getpid()}")
    if entry.dir.exists():
        entry.dir.rename(old)
    tmp.rename(entry.dir)
    shutil.rmtree(old, ignore_errors=True)
    log(f"[zoo] {entry.name}: stored in {entry.dir.relative_to(REPO_ROOT)} "
        f"({sum(v['bytes'] for v in manifest['files'].values()) / 1e6:.1f} MB)")
    return manifest
