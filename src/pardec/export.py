"""Export a pardec-trained EAGLE-3 or DFlash drafter for serving: ``python -m pardec.export <drafter dir> --format F
--out DIR``. Each exported drafter type's layouts, checks, notes and serving commands are its exporter's
(:class:`pardec.models.drafter_types.Exporter`: :mod:`pardec.models.eagle_export`, :mod:`pardec.models.dflash_export`);
this module reads the drafter, checks the verifier and writes the files.

Reads a pardec drafter directory (``drafter.json`` with ``kind: eagle3`` or ``kind: dflash`` + ``drafter.safetensors``,
as training saves it) and writes it in one of the published layouts, weights in the drafter's own dtype.
EAGLE-3 (:mod:`pardec.models.eagle_formats`):

* ``eagle3``: the original release's layout (``config.json`` a one-layer LlamaConfig with ``architectures
  ["LlamaForCausalLMEagle3"]`` and ``draft_vocab_size``; ``model.safetensors`` with ``midlayer.*``), served by vLLM
  and SGLang;
* ``speculators``: vLLM ``speculators``' layout (``config.json`` with ``speculators_model_type: eagle3`` and
  ``speculators_config``; ``model.safetensors`` with ``layers.0.*``), served by vLLM.

DFlash (:mod:`pardec.models.dflash_formats`):

* ``dflash``: the z-lab release layout (``config.json`` a Qwen3Config with ``architectures ["DFlashDraftModel"]``,
  ``block_size`` and ``dflash_config: {mask_token_id, target_layer_ids}``), served by vLLM (``method: dflash``) and
  SGLang (``--speculative-algorithm DFLASH``);
* ``speculators``: ``speculators``' ``dflash`` layout (``speculators_model_type: dflash``).

Bad input (a directory that is not a pardec EAGLE-3 or DFlash drafter, a format of the other drafter, an existing
non-empty ``--out``) is one ``error:`` line, exit status 2, and nothing written. ``load_eagle3`` / ``load_dflash``
load any export back.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import hf_hub_download
from safetensors.torch import load_file, save_file

from pardec.config import ConfigError
from pardec.models.checkpoints import read_json
from pardec.models.drafter_types import exported_types, exporter
from pardec.models.drafters import FORMAT, read_meta


def export_formats() -> tuple[str, ...]:
    """Every layout some drafter type exports to (each type's first: its own release's layout; then the shared)."""
    out: list[str] = []
    for kind in exported_types():
        out += [f for f in exporter(kind).formats if f not in out]
    return tuple(sorted(out, key=lambda f: f == "speculators"))


PROG = "python -m pardec.export"


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``prog: error: ...``, exit status 2), without the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser(prog: str) -> _Parser:
    ap = _Parser(prog=prog, description=__doc__.split("\n\n", 1)[1],
                 formatter_class=argparse.RawDescriptionHelpFormatter,
                 epilog="serving an export (TARGET: the model the drafter was trained on, N: draft tokens):\n"
                        "  vllm serve TARGET --speculative-config "
                        "'{\"method\": \"eagle3\", \"model\": \"OUT\", \"num_speculative_tokens\": N}'\n"
                        "  python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 "
                        "--speculative-draft-model-path OUT\n"
                        "      --speculative-num-steps N --speculative-eagle-topk 1 --speculative-num-draft-tokens N+1")
    ap.add_argument("drafter", help="a pardec EAGLE-3 or DFlash drafter directory (drafter.json kind eagle3 | dflash)")
    ap.add_argument("--format", required=True, choices=export_formats(), help="the layout to write: "
                    + " or ".join(export_formats()))
    ap.add_argument("--out", required=True, help="the directory to write (new or empty)")
    ap.add_argument("--verifier", default=None, help="the target as a Hub id or a local directory: recorded in the "
                    "speculators config (name and architectures) and, when its config.json is readable, checked "
                    "against the drafter's shape")
    ap.add_argument("--speculative-tokens", type=int, default=None, metavar="N",
                    help="draft tokens per step recorded in the speculators config, and in the printed serving "
                         "commands (default: 3 for EAGLE-3, block_size - 1 for DFlash)")
    ap.add_argument("--with-embeddings", default=None, metavar="TARGET_DIR",
                    help="also store the target's token embedding (embed_tokens.weight, read from TARGET_DIR's "
                         "safetensors) in the export; by default it is left out and the servers share the target's")
    return ap


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """The CLI; 0 on success, 2 (one ``error:`` line, nothing written) on bad input."""
    ap = _parser(prog or PROG)
    a = ap.parse_args(argv)
    try:
        written = export(a.drafter, a.format, a.out, verifier=a.verifier, speculative_tokens=a.speculative_tokens,
                         with_embeddings=a.with_embeddings)
    except ConfigError as e:
        ap.error(str(e))
    n, target = written["speculative_tokens"], a.verifier or "TARGET"
    print(f"wrote {a.out} ({a.format} format: {', '.join(written['files'])}; {written['dtype']}, "
          f"{written['described']})")
    for note in written["notes"]:
        print(f"note: {note}")
    for line in exporter(written["kind"]).serve(a.out, target, a.format, n):
        print(line)
    return 0


def export(drafter: str | Path, fmt: str, out: str | Path, *, verifier: str | None = None,
           speculative_tokens: int | None = None, with_embeddings: str | Path | None = None) -> dict:
    """Write the pardec EAGLE-3 or DFlash drafter at ``drafter`` to ``out`` in ``fmt``; every check runs before
    anything is written. Returns {"kind", "config": the type's config (Eagle3Config, DFlashConfig), "files": names written,
    "dtype", "notes", "speculative_tokens"}."""
    if fmt not in export_formats():
        raise ConfigError(f"--format={fmt!r} is not valid; choose one of: {', '.join(export_formats())}")
    if speculative_tokens is not None and speculative_tokens < 1:
        raise ConfigError(f"--speculative-tokens={speculative_tokens} is out of range: it must be an integer >= 1")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out={str(out)!r} exists and is not an empty directory; choose a new or empty one")
    meta, state, config = _read_drafter(drafter)
    kind = meta["kind"]
    ex = exporter(kind)
    if fmt not in ex.formats:
        raise ConfigError(f"--format={fmt!r} is not a layout of {kind} drafters; they export to: "
                          f"{', '.join(ex.formats)}")
    notes: list[str] = []
    architectures, verifier_notes = [], []
    if verifier is not None:
        architectures = _verifier_architectures(verifier, meta, verifier_notes)
    elif fmt == "speculators":
        verifier_notes.append("no --verifier: the speculators config names no verifier (vLLM takes the target from "
                              "its command line)")
    weights, cfg_json, n = ex.write(meta, state, config, fmt, verifier=verifier, architectures=architectures,
                                    speculative_tokens=speculative_tokens, with_embeddings=with_embeddings,
                                    notes=notes)
    dtype = next(v.dtype for v in weights.values() if v.is_floating_point())  # the drafter's own
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
    return {"kind": kind, "config": config, "files": ["config.json", "model.safetensors"],
            "dtype": str(dtype).removeprefix("torch."), "notes": notes + verifier_notes, "speculative_tokens": n,
            "described": ex.describe(config)}


def _read_drafter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor], Any]:
    """drafter.json, the state dict and the config of a pardec EAGLE-3 or DFlash drafter directory, checked (keys
    and shapes against the module its config builds; EAGLE-3: d2t against t2d)."""
    p = Path(path)
    key = "drafter"
    expected = ("a pardec EAGLE-3 or DFlash drafter directory (drafter.json with kind 'eagle3' or 'dflash' + "
                "drafter.safetensors)")
    if not p.is_dir():
        raise ConfigError(f"{key}={str(path)!r} is not a directory; expected {expected}")
    if not (p / "drafter.json").is_file():
        raise ConfigError(f"{key}={str(path)!r} has no drafter.json; expected {expected}")
    meta = read_meta(p, key)
    kind = meta.get("kind")
    exported = exported_types()
    if kind not in exported or not isinstance(meta.get(kind), dict):
        raise ConfigError(f"{key}={str(path)!r} holds a {kind!r} drafter; only kinds "
                          f"{', '.join(repr(k) for k in exported)} export")
    if not (p / "drafter.safetensors").is_file():
        raise ConfigError(f"{key}={str(path)!r} has no drafter.safetensors next to its drafter.json ({FORMAT})")
    try:
        state = load_file(str(p / "drafter.safetensors"))
        config, shapes = exporter(kind).config(meta, state)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(f"{key}={str(path)!r}: its drafter does not load ({type(e).__name__}: {e})") from None
    have = {k: tuple(v.shape) for k, v in state.items()}
    if have != shapes:
        bad = sorted(set(have) ^ set(shapes)) or [k for k in shapes if have[k] != shapes[k]]
        raise ConfigError(f"{key}={str(path)!r}: drafter.safetensors does not fit its drafter.json "
                          f"(keys or shapes differ: {', '.join(bad)})")
    return meta, state, config


def _verifier_architectures(verifier: str, meta: dict, notes: list[str]) -> list[str]:
    """The verifier's ``architectures`` from its config.json (a local directory, or the Hub), its shape checked
    against the drafter's; an unreachable Hub config is a note, not an error."""
    p = Path(verifier).expanduser()
    if p.exists():
        f = p / "config.json"
        if not f.is_file():
            raise ConfigError(f"--verifier={verifier!r} is a local path without a config.json; give the target's "
                              f"model directory or its Hub id")
        cfg = read_json(f, "--verifier")
    else:
        try:
            cfg = json.loads(Path(hf_hub_download(verifier, "config.json")).read_text())
        except Exception as e:  # noqa: BLE001 (offline or no such repo: recorded by name only)
            notes.append(f"could not read --verifier {verifier!r}'s config.json ({type(e).__name__}); its "
                         f"architectures are left empty and its shape unchecked")
            return []
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    for name in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if name in text and name in meta and int(text[name]) != int(meta[name]):
            raise ConfigError(f"--verifier={verifier!r} has {name} {text[name]}; the drafter was trained for "
                              f"{meta.get('base_model')!r} with {name} {meta[name]}")
    return [str(a) for a in cfg.get("architectures") or []]


if __name__ == "__main__":
    sys.exit(main())
