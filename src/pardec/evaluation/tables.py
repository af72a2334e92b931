"""A run summary's rows and its printed tables: :func:`comparison_rows` (baseline, peers and method, each with
its :func:`method_label`: the one renderer of a ``summary.json`` that every table builds on), :func:`format_table`
(the summary, then the side-by-side comparison) and :func:`format_comparison` (the roles in one aligned table)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pardec.decoding.base import METHODS, method_params


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "–"
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def method_label(method: str, params: dict | None = None) -> str:
    """``method (key=value, ...)`` with the parameters that differ from the method's defaults (a long path, e.g.
    trained heads, by its last three parts): how every table names a run's method or a ``bench.also`` role."""
    if not params:
        return method
    defaults = {k: p.default for k, p in method_params(METHODS.get(method)).items()} if method in METHODS else {}

    def short(v):
        parts = Path(v).parts if isinstance(v, str) and "/" in v else ()
        return "…/" + "/".join(parts[-3:]) if len(parts) > 3 else v

    shown = ", ".join(f"{k}={short(v)}" for k, v in sorted(params.items()) if defaults.get(k, object()) != v)
    return f"{method} ({shown})" if shown else method


#: the numbers of a role in a summary: the run's method has them at the top level, the baseline with a
#: ``baseline_`` prefix (where it has them), each peer in its entry of ``peers``
ROLE_KEYS = ("exactness", "tokens_per_s", "decode_tokens_per_s", "speedup", "speedup_std", "speedup_median",
             "tokens_per_forward", "exact_match_rate", "draft_acceptance", "draft_time_share", "draft_forwards",
             "perplexity", "metric", "energy_j_per_token")
BASELINE_KEYS = ("tokens_per_s", "decode_tokens_per_s", "tokens_per_forward", "perplexity", "metric",
                 "energy_j_per_token")


def comparison_rows(s: dict) -> list[dict[str, Any]]:
    """A run summary (``summary.json``) as one row per role, the one reading of a summary that every table uses
    (evaluate's printed table, ``python -m pardec.report runs``, ``pardec.bench speed``'s table, the reports):
    the baseline first (speedup 1.0), the peers (transformers' decoders, ``bench.also`` roles), then the run's
    method when it is not the baseline. Each row: ``role``, ``method``, ``params``, ``label``
    (:func:`method_label`) and the :data:`ROLE_KEYS` numbers (None: not measured)."""
    rows = []
    if s.get("baseline"):
        base = {k: s.get(f"baseline_{k}") if k in BASELINE_KEYS else None for k in ROLE_KEYS}
        base["speedup"] = 1.0 if s.get("baseline_tokens_per_s") else None
        rows.append({"role": "baseline", "method": s["baseline"], "params": {}, "label": s["baseline"], **base})
    for role, p in (s.get("peers") or {}).items():
        params = p.get("params") or {}
        rows.append({"role": role, "params": params, "label": method_label(p["method"], params),
                     **{k: p.get(k) for k in ROLE_KEYS}, **{k: v for k, v in p.items() if k not in ("params",)}})
    if s["method"] != s.get("baseline"):
        params = s.get("method_params") or {}
        rows.append({"role": "method", "method": s["method"], "params": params,
                     "label": method_label(s["method"], params), **{k: s.get(k) for k in ROLE_KEYS}})
    return rows


def format_comparison(s: dict) -> str:
    """:func:`comparison_rows` as an aligned text table."""
    head = ("role", "method", "tokens/s", "decode tokens/s", f"speedup vs {s['baseline']}", "tokens/forward",
            "exact match",
            "draft acceptance", "draft time share", "energy J/token")
    body = [(r["role"], r["method"], _fmt(r["tokens_per_s"], ".2f"), _fmt(r.get("decode_tokens_per_s"), ".2f"),
             _fmt(r["speedup"], ".2f"),
             _fmt(r["tokens_per_forward"], ".2f"), _fmt(r["exact_match_rate"], ".2f"),
             _fmt(r.get("draft_acceptance"), ".2f"), _fmt(r.get("draft_time_share"), ".2f"),
             _fmt(r.get("energy_j_per_token"), ".4g"))
            for r in comparison_rows(s)]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(f"{x:<{w}}" for x, w in zip(line, widths)).rstrip() for line in (head, *body))


def _energy_rows(s: dict) -> list[tuple[str, Any]]:
    """The energy row(s) of :func:`format_table`: J/token of method and baseline, or "not measured: <reason>"."""
    e = s.get("energy") or {}
    if not e.get("measured"):
        return [("energy J/token (method / baseline)", f"not measured: {e.get('reason') or 'no energy meter'}")]
    rows = [("energy J/token (method / baseline)",
             f"{_fmt(s.get('energy_j_per_token'), '.4g')} / {_fmt(s.get('baseline_energy_j_per_token'), '.4g')}")]
    return rows + [("energy counters", "; ".join(x for x in (e.get("devices"), e.get("reason")) if x) or None)]


def _divergence_row(s: dict) -> tuple[str, str] | None:
    """Divergences from the baseline and near-ties among them, per role that diverged (None: none did)."""
    roles = [("method", s)] + list((s.get("peers") or {}).items())
    hit = [(role, r["n_divergences"], r.get("n_near_ties")) for role, r in roles if r.get("n_divergences")]
    if not hit:
        return None
    return ("divergences (near-ties)", ", ".join(f"{role} {n} ({_fmt(k)})" for role, n, k in hit)
            + f"; near-tie: target margin < {s.get('near_tie_ulps')} ulps of {s['dtype']}")


def format_table(s: dict) -> str:
    """A summary (``summary.json``) as the aligned two-column table evaluate prints, then :func:`format_comparison`."""
    rows = [
        ("method", s["method"]), ("baseline", s["baseline"]), ("dataset", s["dataset"]), ("model", s["model"]),
        ("draft", s.get("draft")), ("dtype", s["dtype"]), ("n_samples", s["n_samples"]), ("repeats", s["repeats"]),
        ("exactness", s.get("exactness")),
        ("tokens/s", f"{_fmt(s['tokens_per_s'], '.2f')} ± {_fmt(s['tokens_per_s_std'], '.2f')}"),
        ("baseline tokens/s", f"{_fmt(s['baseline_tokens_per_s'], '.2f')} ± {_fmt(s['baseline_tokens_per_s_std'], '.2f')}"),
        ("hf generate tokens/s", _fmt(s["hf_tokens_per_s"], ".2f")),
        ("speedup (total time)", f"{_fmt(s['speedup'], '.3f')} ± {_fmt(s['speedup_std'], '.3f')}"),
        ("speedup (median prompt)", _fmt(s["speedup_median"], ".3f")),
        ("tokens / target forward", _fmt(s["tokens_per_forward"], ".3f")),
        ("exact match vs baseline", _fmt(s["exact_match_rate"], ".3f")),
        (f"{s['metric_name']} (method / baseline)", f"{_fmt(s['metric'])} / {_fmt(s['baseline_metric'])}"),
        ("perplexity (method / baseline)", f"{_fmt(s['perplexity'])} / {_fmt(s['baseline_perplexity'])}"
         + (f" (scored by {s['perplexity_scorer']})" if s.get("perplexity_scorer") else "")),
        *_energy_rows(s),
        ("peak RSS MB", _fmt(s["peak_rss_mb"], ".0f")),
    ]
    if s.get("draft") or s.get("draft_acceptance") is not None:
        rows += [("draft forwards", _fmt(s.get("draft_forwards"))),
                 ("draft acceptance", _fmt(s.get("draft_acceptance"), ".3f")),
                 ("mean accepted length", _fmt(s.get("mean_accepted_length"), ".3f")),
                 ("draft share of wall time", _fmt(s.get("draft_time_share"), ".3f"))]
    rows += [(k, _fmt(v)) for k, v in s["extras"].items()]
    if s.get("pass_at_k"):
        rows += [(k, _fmt(v)) for k, v in s["pass_at_k"].items()]
    if (div := _divergence_row(s)) is not None:
        rows.append(div)
    if s.get("ranks"):
        rows.append(("ranks", "; ".join(f"{x['rank']}: {x['host']} {x['device']}" for x in s["ranks"])))
    if (busy := s.get("busy") or {}).get("records"):
        rows.append(("BUSY host", f"{busy['records']} of {busy['of']} timed records ran while other processes used "
                                  f"> {busy['threshold_cores']} cores: their timing is disturbed "
                                  f"({', '.join(f'{r} {n}' for r, n in busy['by_role'].items())})"))
    if s["skipped"]:
        rows.append(("skipped prompts", len(s["skipped"])))
    if s.get("n_errors"):
        first = s["errors"][0]
        rows.append(("errors", f"{s['n_errors']} (first: {first['role']} on {first['id']}: {first['error']})"))
    w = max(len(k) for k, _ in rows)
    table = "\n".join(f"{k:<{w}}  {'–' if v is None else v}" for k, v in rows)
    return table + "\n\n" + format_comparison(s)
