"""Export a pardec-trained EAGLE-3 or DFlash drafter for serving: ``python -m pardec.export <drafter dir> --format F
--out DIR``.

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

import torch
from safetensors.torch import load_file, save_file

from pardec.config import ConfigError
from pardec.models.dflash import DFlashConfig, DFlashDraft
from pardec.models.eagle import Eagle3Config, Eagle3Draft
from pardec.models.eagle_formats import (
    eagle3_config_json,
    external_state,
    read_json,
    speculators_config_json,
    target_embedding,
)
from pardec.models.heads import FORMAT, read_meta
from pardec.models.vocab import DraftVocab

#: the layouts each drafter kind exports to
KIND_FORMATS = {"eagle3": ("eagle3", "speculators"), "dflash": ("dflash", "speculators")}
EXPORT_FORMATS = ("eagle3", "dflash", "speculators")
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
    ap.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="the layout to write: "
                    + " or ".join(EXPORT_FORMATS))
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
    cfg, n = written["config"], written["speculative_tokens"]
    target = a.verifier or "TARGET"
    if written["kind"] == "dflash":
        print(f"wrote {a.out} ({a.format} format: {', '.join(written['files'])}; {written['dtype']}, "
              f"{cfg.num_hidden_layers} layers, block {cfg.block_size}, target layers {cfg.layer_ids})")
        for note in written["notes"]:
            print(f"note: {note}")
        print("serve with vLLM:\n  vllm serve " + target + " --speculative-config "
              + "'" + json.dumps({"method": "dflash", "model": str(a.out), "num_speculative_tokens": n}) + "'")
        print(f"serve with SGLang:\n  python -m sglang.launch_server --model-path {target} --speculative-algorithm "
              f"DFLASH --speculative-draft-model-path {a.out} --speculative-num-draft-tokens {n + 1}")
        return 0
    print(f"wrote {a.out} ({a.format} format: {', '.join(written['files'])}; {written['dtype']}, draft vocabulary "
          f"{cfg.draft_vocab_size} of {cfg.vocab_size}, feature layers {cfg.layer_ids})")
    for note in written["notes"]:
        print(f"note: {note}")
    print("serve with vLLM:\n  vllm serve " + target + " --speculative-config "
          + "'" + json.dumps({"method": "eagle3", "model": str(a.out), "num_speculative_tokens": n}) + "'")
    print(("serve with SGLang" + (" (its eagle3 loader names the layer midlayer.*: prefer --format eagle3)"
                                  if a.format == "speculators" else "") + ":\n")
          + f"  python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {a.out} --speculative-num-steps {n} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {n + 1}")
    return 0


def export(drafter: str | Path, fmt: str, out: str | Path, *, verifier: str | None = None,
           speculative_tokens: int | None = None, with_embeddings: str | Path | None = None) -> dict:
    """Write the pardec EAGLE-3 or DFlash drafter at ``drafter`` to ``out`` in ``fmt``; every check runs before
    anything is written. Returns {"kind", "config": its Eagle3Config / DFlashConfig, "files": names written,
    "dtype", "notes", "speculative_tokens"}."""
    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"--format={fmt!r} is not valid; choose one of: {', '.join(EXPORT_FORMATS)}")
    if speculative_tokens is not None and speculative_tokens < 1:
        raise ConfigError(f"--speculative-tokens={speculative_tokens} is out of range: it must be an integer >= 1")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out={str(out)!r} exists and is not an empty directory; choose a new or empty one")
    meta, state, config = _read_drafter(drafter)
    kind = meta["kind"]
    if fmt not in KIND_FORMATS[kind]:
        raise ConfigError(f"--format={fmt!r} is not a layout of {kind} drafters; they export to: "
                          f"{', '.join(KIND_FORMATS[kind])}")
    if kind == "dflash":
        return _export_dflash(meta, state, config, fmt, out, verifier, speculative_tokens, with_embeddings)
    speculative_tokens = 3 if speculative_tokens is None else speculative_tokens
    dtype = state["lm_head.weight"].dtype
    vocab_reduced = config.draft_vocab_size < config.vocab_size
    notes = []
    if len(config.layer_ids) != 3:
        notes.append(f"the drafter fuses {len(config.layer_ids)} target layers; vLLM's and SGLang's EAGLE-3 drafts "
                     f"fuse exactly 3")
    if config.norm_before_residual and fmt == "eagle3":
        notes.append("the drafter uses norm_before_residual, which vLLM reads but SGLang's and the original "
                     "release's EAGLE-3 layers ignore: serve it with vLLM")
    arch: list[str] = []
    if verifier is not None:
        arch = _verifier_architectures(verifier, meta, notes)
    elif fmt == "speculators":
        notes.append("no --verifier: the speculators config names no verifier (vLLM takes the target from its "
                     "command line)")
    weights = external_state(state, fmt, vocab_reduced)
    if with_embeddings is not None:
        emb = target_embedding(with_embeddings)
        want = (config.vocab_size, config.hidden_size)
        if tuple(emb.shape) != want:
            raise ConfigError(f"--with-embeddings={str(with_embeddings)!r}: its embedding is {tuple(emb.shape)}; the "
                              f"drafter needs {want} (vocab_size, hidden_size)")
        weights["embed_tokens.weight"] = emb.to(dtype).contiguous()
    if fmt == "eagle3":
        cfg_json = eagle3_config_json(config, dtype)
    else:
        cfg_json = speculators_config_json(config, dtype, speculative_tokens, verifier, arch)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
    return {"kind": "eagle3", "config": config, "files": ["config.json", "model.safetensors"],
            "dtype": str(dtype).removeprefix("torch."), "notes": notes, "speculative_tokens": speculative_tokens}


def _export_dflash(meta: dict, state: dict[str, torch.Tensor], config: DFlashConfig, fmt: str, out: Path,
                   verifier: str | None, speculative_tokens: int | None, with_embeddings) -> dict:
    """The DFlash half of :func:`export` (its checks are done)."""
    from pardec.models.dflash_formats import speculators_config_json as dflash_speculators_json
    from pardec.models.dflash_formats import zlab_config_json

    n = config.block_size - 1 if speculative_tokens is None else speculative_tokens
    if n > config.block_size - 1:
        raise ConfigError(f"--speculative-tokens={n} is out of range: a block of {config.block_size} proposes at most "
                          f"{config.block_size - 1}")
    if with_embeddings is not None:
        raise ConfigError("--with-embeddings applies to EAGLE-3 only: DFlash's drafts always share the target's "
                          "embedding (the published layouts store none)")
    dtype = state["norm.weight"].dtype
    notes = []
    if config.mask_token_id is None:
        notes.append("the drafter's mask slot is a learned embedding (mask_embedding, written with the weights; "
                     "mask_token_id null): pardec loads it back, but vLLM and SGLang embed a mask token id from the "
                     "target's table and do not read it; to serve, train with heads.mask_token_id=<a spare row>")
    if config.fusion == "layerwise":
        notes.append("the drafter uses DFlare's layer-wise fusion (layer_mix, no fc): pardec loads it back, but "
                     "vLLM's and SGLang's DFlash drafts fuse with fc and do not read it")
    arch: list[str] = []
    if verifier is not None:
        arch = _verifier_architectures(verifier, meta, notes)
    elif fmt == "speculators":
        notes.append("no --verifier: the speculators config names no verifier (vLLM takes the target from its "
                     "command line)")
    if fmt == "dflash":
        cfg_json = zlab_config_json(config, dtype, int(meta["num_hidden_layers"]))
    else:
        cfg_json = dflash_speculators_json(config, dtype, verifier, arch)
        cfg_json["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = n
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
    return {"kind": "dflash", "config": config, "files": ["config.json", "model.safetensors"],
            "dtype": str(dtype).removeprefix("torch."), "notes": notes, "speculative_tokens": n}


def _read_drafter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor], Eagle3Config | DFlashConfig]:
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
    if kind not in KIND_FORMATS or not isinstance(meta.get(kind), dict):
        raise ConfigError(f"{key}={str(path)!r} holds a {kind!r} drafter; only kinds "
                          f"{', '.join(repr(k) for k in KIND_FORMATS)} export")
    if not (p / "drafter.safetensors").is_file():
        raise ConfigError(f"{key}={str(path)!r} has no drafter.safetensors next to its drafter.json ({FORMAT})")
    try:
        state = load_file(str(p / "drafter.safetensors"))
        if kind == "dflash":
            config = DFlashConfig.from_dict(meta["dflash"])
            with torch.device("meta"):
                shapes = {k: tuple(v.shape) for k, v in DFlashDraft(config).state_dict().items()}
        else:
            config = Eagle3Config.from_dict(meta["eagle3"])
            DraftVocab.from_maps(state["d2t"], state["t2d"], config.vocab_size)  # raises when they disagree
            with torch.device("meta"):  # shapes only: nothing allocated
                stand_in = DraftVocab(range(config.draft_vocab_size), config.vocab_size)
                shapes = {k: tuple(v.shape) for k, v in Eagle3Draft(config, stand_in).state_dict().items()}
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
            from huggingface_hub import hf_hub_download

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
