"""How a zoo artifact is stored, and rebuilt into what the loaders read.

:func:`pack` copies what an entry keeps of a run's ``final/`` into an artifact directory, applying its ``store``:

* ``dtype: bf16`` — floating tensors of every ``*.safetensors`` cast to bf16 (for drafters whose decoding stays exact
  whatever their weights: the loaders cast them back to the run's dtype);
* ``lowrank: {tensors: <regex>, base: [<target tensor names>], rank: r}`` — each matching tensor ``W`` kept as the
  target's own tensor ``B`` (the first of ``base`` its weights hold) plus a rank-``r`` delta ``W ~= B + U V``
  (truncated SVD of ``W - B``): ``<name>.lowrank_u`` [out, r] and ``<name>.lowrank_v`` [r, in]; ``B`` is never stored;
* ``from_target: {<tensor>: <target tensor>}`` — tensors training left equal to the target's (a draft's frozen
  embeddings): checked equal, not stored, copied back from the target.

:func:`materialize` is the inverse for a directory whose manifest names a ``lowrank`` or ``from_target`` form: the full
tensors once into ``data/zoo/<zoo>/<name>-<sha12>/`` (keyed by the stored weights' hash, so an altered artifact never
reuses a stale copy); other artifacts are read where they are.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pardec import DATA_DIR
from pardec.config import ConfigError

U_SUFFIX, V_SUFFIX = ".lowrank_u", ".lowrank_v"
STORE_KEYS = {"dtype", "lowrank", "from_target"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_store(store: dict, where: str) -> None:
    unknown = set(store) - STORE_KEYS
    if unknown:
        raise ConfigError(f"{where}: store has unknown key(s) {sorted(unknown)}; valid: {sorted(STORE_KEYS)}")
    if store.get("dtype") not in (None, *DTYPES):
        raise ConfigError(f"{where}: store.dtype={store['dtype']!r} is not valid; choose one of: {', '.join(DTYPES)}")
    low = store.get("lowrank")
    if low is not None and (set(low) != {"tensors", "base", "rank"} or int(low["rank"]) < 1):
        raise ConfigError(f"{where}: store.lowrank={low!r} needs tensors (a regex), base (target tensor names) and "
                       f"rank >= 1")


def target_tensor(weights_dir: Path, names: list[str]) -> tuple[str, torch.Tensor]:
    """The first of ``names`` that the target's safetensors files hold (a tied LM head is stored as the embedding)."""
    files = sorted(Path(weights_dir).glob("*.safetensors"))
    for name in names:
        for f in files:
            with safe_open(str(f), "pt") as st:
                if name in st.keys():
                    return name, st.get_tensor(name)
    raise FileNotFoundError(f"the target's weights in {weights_dir} hold none of {names}")


def low_rank(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``delta`` [out, in] ~= u [out, r] @ v [r, in]: the truncated SVD (the best rank-r approximation)."""
    u, s, vh = torch.linalg.svd(delta.double(), full_matrices=False)
    r = min(rank, s.numel())
    return (u[:, :r] * s[:r]).float().contiguous(), vh[:r].float().contiguous()


def pack(final: Path, out: Path, keep: list[str], store: dict, weights_dir: Path | None) -> dict[str, Any]:
    """Copy ``keep`` (paths or globs under ``final``) into ``out`` in the ``store`` form; returns the manifest's ``store``
    section: the form, and per reduced tensor its base and the relative error of the approximation."""
    out.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {**store, "tensors": {}}
    low = store.get("lowrank")
    for src in [p for pattern in keep for p in _matches(final, pattern)]:
        rel = src.relative_to(final).as_posix()
        if src.is_dir():
            shutil.copytree(src, out / rel, dirs_exist_ok=True)
            continue
        if src.suffix != ".safetensors":
            shutil.copy2(src, out / rel)
            continue
        tensors = load_file(str(src))
        kept: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if name in store.get("from_target", {}):
                _, base = target_tensor(weights_dir, [store["from_target"][name]])
                if not torch.equal(t, base.to(t.dtype)):
                    raise ValueError(f"{src}: {name} differs from the target's {store['from_target'][name]} (trained?); "
                                     f"it cannot be stored as store.from_target")
                continue
            if low and re.fullmatch(low["tensors"], name):
                base_name, base = target_tensor(weights_dir, list(low["base"]))
                delta = t.float() - base.float()
                u, v = low_rank(delta, int(low["rank"]))
                err = (delta - u @ v).norm() / max(float(t.float().norm()), 1e-30)
                kept_energy = float((u @ v).norm() ** 2 / max(float(delta.norm()) ** 2, 1e-30))
                info["tensors"][name] = {"base": base_name, "rank": u.shape[1], "relative_error": round(float(err), 6),
                                         "delta_norm": round(float(delta.norm()), 6),
                                         "delta_energy_kept": round(kept_energy, 6)}
                kept[name + U_SUFFIX], kept[name + V_SUFFIX] = u, v
            else:
                kept[name] = t
        if store.get("dtype"):
            kept = {k: v.to(DTYPES[store["dtype"]]) if v.is_floating_point() else v for k, v in kept.items()}
        save_file({k: v.contiguous() for k, v in kept.items()}, str(out / rel))
    return info


def _matches(final: Path, pattern: str) -> list[Path]:
    """The paths under ``final`` that a ``keep`` entry names (a path or a glob: ``*.json``); none is an error."""
    found = sorted(final.glob(pattern))
    if not found:
        raise FileNotFoundError(f"{final} holds nothing matching {pattern!r}: the run did not write what the zoo keeps")
    return found


def materialize(artifact: Path, manifest: dict) -> Path:
    """The directory a loader reads for a verified artifact: itself, or (a ``lowrank`` form) its full tensors
    rebuilt once against the target's weights under ``data/zoo/``."""
    store = manifest.get("store") or {}
    if not store.get("lowrank") and not store.get("from_target"):
        return artifact
    from pardec.models.loading import build_once, named_config, weights_location

    digest = hashlib.sha256("".join(v["sha256"] for _, v in sorted(manifest["files"].items())).encode()).hexdigest()[:12]
    out = DATA_DIR / "zoo" / artifact.parent.name / f"{manifest['name']}-{digest}"

    def build(tmp: Path) -> None:
        weights = Path(weights_location(named_config(manifest["target"]["name"])))
        shutil.copytree(artifact, tmp, ignore=shutil.ignore_patterns("manifest.json", "*.safetensors"))
        for f in sorted(artifact.rglob("*.safetensors")):
            stored = load_file(str(f))
            full = {k: v for k, v in stored.items() if not k.endswith((U_SUFFIX, V_SUFFIX))}
            for name, base_name in (store.get("from_target") or {}).items():
                full[name] = target_tensor(weights, [base_name])[1]
            for name, t in stored.items():
                if name.endswith(U_SUFFIX):
                    base_name = name[: -len(U_SUFFIX)]
                    _, base = target_tensor(weights, [store["tensors"][base_name]["base"]])
                    full[base_name] = (base.float() + t.float() @ stored[base_name + V_SUFFIX].float()).contiguous()
            (tmp / f.relative_to(artifact)).parent.mkdir(parents=True, exist_ok=True)
            save_file(full, str(tmp / f.relative_to(artifact)))
        (tmp / ".complete").write_text("")

    return build_once(out, lambda d: (d / ".complete").is_file(), build)
