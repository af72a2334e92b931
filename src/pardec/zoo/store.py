"""How a zoo artifact is stored, and rebuilt into what the loaders read.

:func:`pack` copies what an entry keeps of a run's ``final/`` into an artifact directory, applying its ``store``:

* ``dtype: bf16`` — floating tensors of every ``*.safetensors`` cast to bf16 (for drafters whose decoding stays exact
  whatever their weights: the loaders cast them back to the run's dtype);
* ``lowrank: {tensors: <regex>, base: [<target tensor names>], rank: r}`` — each matching tensor ``W`` kept as the
  target's own tensor ``B`` (the first of ``base`` its weights hold) plus a rank-``r`` delta ``W ~= B + U V``
  (truncated SVD of ``W - B``): ``<name>.lowrank_u`` [out, r] and ``<name>.lowrank_v`` [r, in]; ``B`` is never stored;
* ``from_target: {<tensor>: <target tensor>}`` — tensors training left equal to the target's (a draft's frozen
  embeddings): checked equal, not stored, copied back from the target;
* ``target_delta: {tensors: <regex>, rank: r}`` — a fine-tune of the target itself, each tensor against the target's
  tensor of the same name: equal ones are not stored (``unchanged``), matching ones are kept as a rank-``r`` delta as
  above (exact up to rounding for a merged LoRA of rank <= r), ones whose rows only partly differ (an embedding that
  grew by a new token's row) as those rows, ``<name>.rows`` [k, ...] and ``<name>.row_ids`` [k]; others whole.

:func:`materialize` is the inverse for a directory whose manifest names one of :data:`TARGET_FORMS`: the full
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
STORE_KEYS = {"dtype", "lowrank", "from_target", "target_delta"}
ROWS_SUFFIX, ROW_IDS_SUFFIX = ".rows", ".row_ids"
#: the forms :func:`materialize` rebuilds against the target's weights (the others are read as stored)
TARGET_FORMS = ("lowrank", "from_target", "target_delta")
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
    delta = store.get("target_delta")
    if delta is not None and (set(delta) != {"tensors", "rank"} or int(delta["rank"]) < 1):
        raise ConfigError(f"{where}: store.target_delta={delta!r} needs tensors (a regex) and rank >= 1")
    if delta is not None and (low is not None or store.get("from_target")):
        raise ConfigError(f"{where}: store.target_delta already reads every tensor against the target's own; drop "
                          f"store.lowrank / store.from_target")


def target_tensor(weights_dir: Path, names: list[str], missing_ok: bool = False) -> tuple[str, torch.Tensor | None]:
    """The first of ``names`` that the target's safetensors files hold (a tied LM head is stored as the embedding);
    ``missing_ok``: (None, None) where none is."""
    files = sorted(Path(weights_dir).glob("*.safetensors"))
    for name in names:
        for f in files:
            with safe_open(str(f), "pt") as st:
                if name in st.keys():
                    return name, st.get_tensor(name)
    if missing_ok:
        return None, None
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
    low, delta = store.get("lowrank"), store.get("target_delta")
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
            if delta:
                info["tensors"][name] = _against_own(name, t, weights_dir, delta, kept)
                if info["tensors"][name] is None:
                    del info["tensors"][name]
                    info.setdefault("unchanged", []).append(name)
            elif low and re.fullmatch(low["tensors"], name):
                info["tensors"][name] = _low_rank_of(name, t, *target_tensor(weights_dir, list(low["base"])),
                                                     int(low["rank"]), kept)
            else:
                kept[name] = t
        if store.get("dtype"):
            kept = {k: v.to(DTYPES[store["dtype"]]) if v.is_floating_point() else v for k, v in kept.items()}
        save_file({k: v.contiguous() for k, v in kept.items()}, str(out / rel))
    return info


def _low_rank_of(name: str, t: torch.Tensor, base_name: str, base: torch.Tensor, rank: int,
                 kept: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Keep ``t`` as ``base`` + a rank-``rank`` delta (its two factors into ``kept``); the manifest's figures of it."""
    delta = t.float() - base.float()
    u, v = low_rank(delta, rank)
    err = (delta - u @ v).norm() / max(float(t.float().norm()), 1e-30)
    kept_energy = float((u @ v).norm() ** 2 / max(float(delta.norm()) ** 2, 1e-30))
    kept[name + U_SUFFIX], kept[name + V_SUFFIX] = u, v
    return {"base": base_name, "rank": u.shape[1], "relative_error": round(float(err), 6),
            "delta_norm": round(float(delta.norm()), 6), "delta_energy_kept": round(kept_energy, 6)}


def _against_own(name: str, t: torch.Tensor, weights_dir: Path, delta: dict,
                 kept: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """``store.target_delta``: ``t`` against the target's tensor of the same name (None: equal, nothing kept)."""
    _, base = target_tensor(weights_dir, [name], missing_ok=True)
    if base is None or base.shape[1:] != t.shape[1:] or base.shape[0] > t.shape[0]:
        kept[name] = t
        return {"base": None, "form": "whole"}
    base = base.to(t.dtype)
    if base.shape == t.shape and torch.equal(base, t):
        return None
    if base.shape == t.shape and re.fullmatch(delta["tensors"], name) and t.dim() == 2:
        return {**_low_rank_of(name, t, name, base, int(delta["rank"]), kept), "form": "lowrank"}
    n = base.shape[0]
    differ = torch.cat([(t[:n] != base).flatten(1).any(1) if t.dim() > 1 else t[:n] != base,
                        torch.ones(t.shape[0] - n, dtype=torch.bool)])
    ids = differ.nonzero().flatten()
    if 2 * ids.numel() > t.shape[0]:  # most rows changed: the rows form would be no smaller
        kept[name] = t
        return {"base": None, "form": "whole"}
    kept[name + ROWS_SUFFIX], kept[name + ROW_IDS_SUFFIX] = t[ids].contiguous(), ids
    return {"base": name, "form": "rows", "rows": int(t.shape[0]), "changed_rows": int(ids.numel())}


def _matches(final: Path, pattern: str) -> list[Path]:
    """The paths under ``final`` that a ``keep`` entry names (a path or a glob: ``*.json``); none is an error."""
    found = sorted(final.glob(pattern))
    if not found:
        raise FileNotFoundError(f"{final} holds nothing matching {pattern!r}: the run did not write what the zoo keeps")
    return found


def materialize(artifact: Path, manifest: dict) -> Path:
    """The directory a loader reads for a verified artifact: itself, or (a form of :data:`TARGET_FORMS`) its full
    tensors rebuilt once against the target's weights under ``data/zoo/``."""
    store = manifest.get("store") or {}
    if not any(store.get(k) for k in TARGET_FORMS):
        return artifact
    from pardec.models.loading import build_once, named_config, weights_location  # heavy: transformers

    digest = hashlib.sha256("".join(v["sha256"] for _, v in sorted(manifest["files"].items())).encode()).hexdigest()[:12]
    out = DATA_DIR / "zoo" / artifact.parent.name / f"{manifest['name']}-{digest}"

    def build(tmp: Path) -> None:
        weights = Path(weights_location(named_config(manifest["target"]["name"])))
        shutil.copytree(artifact, tmp, ignore=shutil.ignore_patterns("manifest.json", "*.safetensors"))
        for f in sorted(artifact.rglob("*.safetensors")):
            stored = load_file(str(f))
            parts = (U_SUFFIX, V_SUFFIX, ROWS_SUFFIX, ROW_IDS_SUFFIX)
            full = {k: v for k, v in stored.items() if not k.endswith(parts)}
            for name, base_name in (store.get("from_target") or {}).items():
                full[name] = target_tensor(weights, [base_name])[1]
            for name in store.get("unchanged") or []:
                full[name] = target_tensor(weights, [name])[1]
            for name, t in stored.items():
                if name.endswith(U_SUFFIX):
                    base_name = name[: -len(U_SUFFIX)]
                    _, base = target_tensor(weights, [store["tensors"][base_name]["base"]])
                    full[base_name] = (base.float() + t.float() @ stored[base_name + V_SUFFIX].float()).contiguous()
                elif name.endswith(ROWS_SUFFIX):
                    base_name = name[: -len(ROWS_SUFFIX)]
                    _, base = target_tensor(weights, [base_name])
                    whole = torch.zeros((store["tensors"][base_name]["rows"], *base.shape[1:]), dtype=torch.float32)
                    whole[: base.shape[0]] = base.float()
                    whole[stored[base_name + ROW_IDS_SUFFIX]] = t.float()
                    full[base_name] = whole
            (tmp / f.relative_to(artifact)).parent.mkdir(parents=True, exist_ok=True)
            save_file(full, str(tmp / f.relative_to(artifact)))
        (tmp / ".complete").write_text("")

    return build_once(out, lambda d: (d / ".complete").is_file(), build)
