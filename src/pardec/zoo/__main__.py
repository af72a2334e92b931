"""``python -m pardec.zoo list|build|verify|rehash|keep-corpus [names] [--zoo smollm2]``: the kept drafters (:mod:`pardec.zoo`)."""

from __future__ import annotations

import argparse
import json
import sys

from pardec.config import ConfigError
from pardec.zoo import DEFAULT_TARGET, MANIFEST, check_names, corpus, entries, recipe_hash, verify
from pardec.zoo.rehash import recipes_at, rehash


def headline(metrics: dict | None) -> str:
    """The figure a drafter's held-out evaluation leads with: expected tokens per forward (EAGLE-3, DFlash), the
    best searched tree's expected accepted length (Medusa, FIRP), SDSAT's expected tokens per two-step loop against
    the model's own greedy tokens (and the held-out text's perplexity against the base's), CLLM's fast-forward
    (tokens committed per Jacobi iteration; the base model's beside it where measured), else top-1 agreement."""
    m = metrics or {}
    if isinstance(m.get("trained"), dict):  # CLLM, per held-out set: the trained model's figures (and the base's)
        base = (m.get("base") or {}).get("fast_forward")
        m = {**m["trained"], **({"base_fast_forward": base} if base is not None else {})}
    if "fast_forward" in m:
        base = m.get("base_fast_forward")
        return f"fast-forward {m['fast_forward']:.2f}" + (f" (base {base:.2f})" if base is not None else "")
    adaptive = (m.get("overall") or m).get("adaptive") or {}
    if adaptive.get("expected_tokens_per_loop_vs_model") is not None:
        ratio = (m.get("overall") or m).get("ppl_ratio")
        return (f"E[tokens/loop] {adaptive['expected_tokens_per_loop_vs_model']:.2f}"
                + (f", ppl x{ratio:.3f}" if ratio else ""))
    if "expected_tokens_per_forward" in m:
        return f"E[tokens/forward] {m['expected_tokens_per_forward']:.2f}"
    trees = m.get("trees") or {}
    if trees:
        name, best = max(trees.items(), key=lambda kv: kv[1]["expected_accept_length"])
        return f"{name} E[accepted] {best['expected_accept_length']:.2f}"
    for key in ("agreement_overall", "agreement"):
        if isinstance(m.get(key), float):
            return f"top-1 agreement {m[key]:.3f}"
    acc = m.get("topk_accuracy") or m.get("rank_accuracy")
    if acc:  # per depth, then rank: the top-1 of each depth
        return "top-1 by depth " + "/".join(f"{d[0]:.2f}" for d in acc)
    return "-"


def stored_form(store: dict) -> str:
    """``bf16, rank-128 delta vs the target's lm_head.weight`` from a manifest's ``store`` section."""
    parts = [store["dtype"]] if store.get("dtype") else []
    if store.get("lowrank"):
        bases = sorted({t["base"] for t in store.get("tensors", {}).values()})
        parts.append(f"rank-{store['lowrank']['rank']} delta vs the target's {', '.join(bases)}")
    if store.get("from_target"):
        parts.append(f"{', '.join(store['from_target'])} from the target")
    if store.get("target_delta"):
        forms = [t.get("form") for t in (store.get("tensors") or {}).values()]
        parts.append(f"the target + rank-{store['target_delta']['rank']} deltas of {forms.count('lowrank')} linears, "
                     f"{forms.count('rows')} tensor(s) by changed rows, {forms.count('whole')} whole, "
                     f"{len(store.get('unchanged') or [])} unchanged (not stored)")
    return ", ".join(parts) or "as trained"


def rows(zoo: str, names: list[str]) -> list[dict]:
    from pardec.zoo.build import status  # heavy: torch

    out = []
    for name in names:
        e = entries(zoo)[name]
        state = status(e, recipe_hash(e))
        row = {"name": name, "status": state, "experiment": e.experiment, "reads": e.reads}
        if (e.dir / MANIFEST).is_file():
            m = json.loads((e.dir / MANIFEST).read_text())
            row.update(mb=round(sum(f["bytes"] for f in m["files"].values()) / 1e6, 1),
                       build_min=round(sum(s["wall_s"] for r in [m, *m.get("bases", [])]
                                           for s in r["stages"].values()) / 60, 1),
                       host=m["host"]["cpu"], date=m["date"][:10], headline=headline(m.get("metrics")),
                       heldout=sorted((m.get("data") or {}).get("heldout") or {}))
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pardec.zoo", description=__doc__.splitlines()[0].split(": ", 1)[-1])
    sub = ap.add_subparsers(dest="command", required=True, metavar="{list,build,verify,rehash,keep-corpus}")
    for name, text in (("list", "what is kept: size, training time and host, held-out figures, whether it matches "
                                "its recipe"),
                       ("build", "(re)train and store every missing or stale artifact (resumable; make zoo)"),
                       ("verify", "check every stored file against its manifest's sha256"),
                       ("rehash", "carry artifacts over a rename of config keys without retraining, where the recipe "
                                  "at --at COMMIT (the one each was built from) is today's but for its spelling"),
                       ("keep-corpus", "keep the completions written so far for artifacts with keep_corpus (also while "
                                       "their generation runs): the next build on any machine goes on from them")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("names", nargs="*", help="artifacts (default: all of the zoo)")
        p.add_argument("--zoo", default=DEFAULT_TARGET, help=f"the zoo (conf/zoo/<zoo>.yaml; default {DEFAULT_TARGET})")
        if name == "build":
            p.add_argument("--force", action="store_true", help="rebuild even when up to date")
        if name == "list":
            p.add_argument("--json", action="store_true", help="print the rows as JSON")
        if name == "rehash":
            p.add_argument("--at", required=True, metavar="COMMIT",
                           help="a commit where each artifact's recipe hash equals its manifest's")
    a = ap.parse_args(argv)
    try:
        names = check_names(a.names, a.zoo)
        if a.command == "verify":
            for name in names:
                if not entries(a.zoo)[name].kept:  # (a base of others only: nothing stored)
                    continue
                m = verify(name, a.zoo)
                print(f"{name}: ok ({len(m['files'])} files match manifest.json)")
            return 0
        if a.command == "rehash":
            at, failed = recipes_at(a.at, a.zoo), 0
            for name in names:
                e = entries(a.zoo)[name]
                if e.kept and (e.dir / MANIFEST).is_file():
                    try:
                        print(rehash(e, at, a.at))
                    except ConfigError as err:  # (that one stays stale; the others go on)
                        print(f"error: {err}", file=sys.stderr)
                        failed += 1
            return 1 if failed else 0
        if a.command == "keep-corpus":
            chosen = [entries(a.zoo)[n] for n in names if entries(a.zoo)[n].keep_corpus]
            if not chosen:
                raise ConfigError(f"none of {', '.join(names)} keeps its corpus (keep_corpus: true in "
                                  f"conf/zoo/{a.zoo}.yaml); those that do: "
                                  f"{', '.join(n for n, e in entries(a.zoo).items() if e.keep_corpus) or 'none'}")
            for e in chosen:
                out = corpus.out_dir_of(e)
                corpus.keep(out, corpus.kept_dir(e, out))
            return 0
        if a.command == "build":
            from pardec.zoo.build import build_one  # heavy: torch

            for name in names:
                build_one(entries(a.zoo)[name], force=a.force)
            return 0
        table = rows(a.zoo, names)
        if a.json:
            print(json.dumps(table, indent=2))
            return 0
        print(f"{'name':<10} {'status':<8} {'MB':>6} {'build min':>9}  {'held-out figure':<26} host, date")
        for r in table:  # build min: every stage of the recipe (data, training, evaluation)
            print(f"{r['name']:<10} {r['status']:<8} {r.get('mb', '-'):>6} {r.get('build_min', '-'):>9}  "
                  f"{r.get('headline', '-'):<26} {r.get('host', '-')}, {r.get('date', '-')}")
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
