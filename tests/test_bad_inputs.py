"""Bad inputs to `python -m evaluate` (formerly ``scripts/bad_inputs.py``): each gets one clear ``error:`` line that
names the bad key or value, with no traceback, before any model loads.

Every case runs the real CLI (:func:`pardec.evaluate.main`, Hydra and all) on a tiny offline configuration
(``model=tiny_random``, HumanEval, one prompt, 4 new tokens), with :func:`pardec.models.loading.load_model` wrapped
so that a model load prints a marker first: an error after the marker came too late. The cases run one after
another in one child process per environment (a fresh process each would cost ~5 s of imports per case), each in a
temporary directory of its own with Hydra's global state cleared in between.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.evaluation.helpers import run_cli_in_one_process

MARKER = "@@pardec: a model is loading@@"
BASE = ("model=tiny_random", "n_samples=1", "max_new_tokens=4", "bench.warmup=0", "perplexity.enabled=false",
        "dataset=humaneval")
#: the children's first lines: load_model announces itself, so an error after the marker came too late
PRELUDE = f"""
import sys
import pardec.models.loading as loading
_load = loading.load_model
def load_model(cfg, *a, **k):
    print({MARKER!r}, file=sys.stderr, flush=True)
    return _load(cfg, *a, **k)
loading.load_model = load_model
"""


@dataclass
class Case:
    name: str
    args: tuple[str, ...]
    needle: str  # the error line must contain this (the bad key or value)
    env: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)  # name -> content, written into the case's temp dir ({tmp} in args)


MEDUSA_META = ('{"format": "pardec-drafter", "version": 1, "kind": "medusa", "base_model": "tiny_random", '
               '"hidden_size": 64, "vocab_size": 8192, "num_hidden_layers": 2, "k": 3, "num_heads": 3}')

CASES = [
    # method parameters
    Case("param type: str for int", ("+method=jacobi", "method.block_size=abc"), "method.block_size='abc'"),
    Case("param type: float for int", ("+method=jacobi", "method.block_size=2.5"), "method.block_size=2.5"),
    Case("param type: int for bool", ("+method=jacobi", "method.record_trajectories=1"), "method.record_trajectories"),
    Case("param type: str for bool", ("+method=sps", "draft=tiny_random", "method.adaptive=maybe"), "method.adaptive"),
    Case("param type: list for int", ("+method=pld", "method.num_pred=[1,2]"), "method.num_pred"),
    Case("param type: str for float", ("+method=hf_assisted", "draft=tiny_random",
                                       "method.assistant_confidence_threshold=high"), "assistant_confidence_threshold"),
    Case("param unknown name", ("+method=jacobi", "+method.blocksize=4"), "blocksize"),
    Case("param out of range", ("+method=jacobi", "method.block_size=0"), "method.block_size=0"),
    Case("param bad choice", ("+method=hf_assisted", "draft=tiny_random", "method.num_assistant_tokens_schedule=x"),
         "num_assistant_tokens_schedule"),
    Case("method: unknown name", ("+method=jacobi", "method.name=jacobo"), "jacobo"),
    Case("method: no such group option", ("+method=nope",), "nope"),
    Case("method: missing", (), "+method"),
    Case("method: needs a draft", ("+method=sps",), "draft"),
    Case("mjsd: needs a draft", ("+method=mjsd",), "draft=<name>"),
    Case("bild: needs a draft", ("+method=bild",), "draft=<name>"),
    Case("spectr: needs a draft", ("+method=spectr",), "draft=<name>"),
    Case("mjsd: num_beams < 1", ("+method=mjsd", "draft=tiny_random", "method.num_beams=0"), "method.num_beams=0"),
    Case("mjsd: width > num_beams", ("+method=mjsd", "draft=tiny_random", "method.width=9"), "method.width=9"),
    Case("mjsd: tau > 1", ("+method=mjsd", "draft=tiny_random", "method.tau=1.5"), "method.tau=1.5"),
    Case("mjgd: K < 1", ("+method=mjgd", "method.K=0"), "method.K=0"),
    Case("spectr: k < 1", ("+method=spectr", "draft=tiny_random", "method.k=0"), "method.k=0"),
    Case("bild: fallback > 1", ("+method=bild", "draft=tiny_random", "method.fallback_threshold=2"),
         "method.fallback_threshold=2"),
    Case("bild: rollback <= 0", ("+method=bild", "draft=tiny_random", "method.rollback_threshold=0"),
         "method.rollback_threshold=0"),
    # trained drafters (medusa / firp): checked from drafter.json and the tree file, before the target loads
    Case("medusa: no heads", ("+method=medusa",), "method.path=<dir>"),
    Case("medusa: heads dir missing", ("+method=medusa", "method.path=/no/such/heads"), "/no/such/heads"),
    Case("medusa: the old key of its heads", ("+method=medusa", "method.heads=/x"), "method.heads is now method.path"),
    Case("firp: the old key of its projections", ("+method=firp", "+method.projections=/x"),
         "method.projections is now method.path"),
    Case("firp: medusa weights", ("+method=firp", "method.path={tmp}"), "holds 'medusa' weights",
         files={"drafter.json": MEDUSA_META}),
    Case("medusa: K < 1 (k=0)", ("+method=medusa", "method.path={tmp}", "method.k=0"), "method.k=0",
         files={"drafter.json": MEDUSA_META}),
    Case("medusa: tree not a tree", ("+method=medusa", "method.path={tmp}", "method.tree={tmp}/t.json"), "t.json",
         files={"drafter.json": MEDUSA_META, "t.json": '{"format": "pardec-tree", "version": 1, "paths": [[0, 1]]}'}),
    Case("medusa: tree not JSON", ("+method=medusa", "method.path={tmp}", "method.tree={tmp}/t.json"), "t.json",
         files={"drafter.json": MEDUSA_META, "t.json": "[[0], [1"}),
    Case("medusa: tree deeper than K", ("+method=medusa", "method.path={tmp}", "method.tree={tmp}/t.json"),
         "exceeds", files={"drafter.json": MEDUSA_META,
                           "t.json": '{"format": "pardec-tree", "version": 1, "paths": [[0], [0, 0], [0, 0, 0], '
                                     '[0, 0, 0, 0]]}'}),
    Case("medusa: unknown tree name", ("+method=medusa", "method.path={tmp}", "method.tree=T99"), "T99",
         files={"drafter.json": MEDUSA_META}),
    # sdsat: the adaptive tokens come from the model's config.json (read before the weights load)
    Case("sdsat: k < 1", ("+method=sdsat", "method.k=0", "method.adaptive_ids=[5]"), "method.k=0"),
    Case("sdsat: bad variant", ("+method=sdsat", "method.variant=tree"), "method.variant='tree'"),
    Case("sdsat: k > L (SDSAT-D)", ("+method=sdsat", "method.adaptive_ids=[5,6,7]", "method.k=5"), "method.k=5"),
    Case("sdsat: a tiny random model (no adaptive token)", ("+method=sdsat",), "no SDSAT adaptive token"),
    Case("sdsat: model without adaptive token", ("+method=sdsat", "model=local", "model.path={tmp}"),
         "+experiment=sdsat_smollm2", files={"config.json": '{"model_type": "llama", "vocab_size": 64}'}),
    # datasets
    Case("dataset: no such group option", ("+method=ar", "dataset=nope"), "nope"),
    Case("dataset: unknown task name", ("+method=ar", "dataset.name=gsm9k"), "gsm9k"),
    Case("dataset: missing file", ("+method=ar", "dataset.path=/no/such/file.jsonl"), "/no/such/file.jsonl"),
    Case("dataset: empty file", ("+method=ar", "dataset.path={tmp}/empty.jsonl"), "empty.jsonl",
         files={"empty.jsonl": ""}),
    Case("dataset: malformed line", ("+method=ar", "dataset.path={tmp}/bad.jsonl"), "bad.jsonl",
         files={"bad.jsonl": '{"task_id": "x"\n'}),
    Case("dataset: bad prompt_style", ("+method=ar", "dataset.prompt_style=fancy"), "dataset.prompt_style"),
    Case("dataset: offline hub", ("+method=ar", "dataset=mt_bench", "dataset.hub_id=pardec-tests/not-cached"),
         "HF_DATASETS_OFFLINE", env={"HF_DATASETS_OFFLINE": "1"}),
    Case("dataset: hub unreachable", ("+method=ar", "dataset=mt_bench", "dataset.hub_id=pardec-tests/not-cached"),
         "pardec-tests/not-cached"),
    # sampling
    Case("sampling.temperature=-1", ("+method=ar", "sampling.temperature=-1"), "sampling.temperature=-1"),
    Case("sampling.top_p=2", ("+method=ar", "sampling.top_p=2"), "sampling.top_p=2"),
    Case("sampling.temperature=hot", ("+method=ar", "sampling.temperature=hot"), "sampling.temperature"),
    # run keys
    Case("max_new_tokens=0", ("+method=ar", "max_new_tokens=0"), "max_new_tokens=0"),
    Case("max_new_tokens=-3", ("+method=ar", "max_new_tokens=-3"), "max_new_tokens=-3"),
    Case("max_new_tokens=abc", ("+method=ar", "max_new_tokens=abc"), "max_new_tokens"),
    Case("n_samples=0", ("+method=ar", "n_samples=0"), "n_samples=0"),
    Case("timeout_s=0", ("+method=ar", "timeout_s=0"), "timeout_s=0"),
    Case("dtype=fp8", ("+method=ar", "dtype=fp8"), "fp8"),
    Case("unknown model key", ("+method=ar", "+model.layerz=3"), "layerz"),
    Case("unknown model key without +", ("+method=ar", "model.layerz=3"), "model.layerz"),
    Case("malformed override", ("+method=ar", "max_new_tokens=[1"), "max_new_tokens=[1"),
    Case("a sweep without -m", ("+method=ar,pld",), "+method=ar,pld"),
    Case("n_samples=abc", ("+method=ar", "n_samples=abc"), "n_samples='abc'"),
    Case("sampling.seed=abc", ("+method=ar", "sampling.seed=abc"), "sampling.seed='abc'"),
    # models and drafts
    Case("model: no such group option", ("+method=ar", "model=nope"), "nope"),
    Case("model: missing local dir", ("+method=ar", "model=local", "model.path=/no/such/dir"), "/no/such/dir"),
    Case("draft: no such group option", ("+method=sps", "draft=nope"), "nope"),
    Case("draft: missing local dir", ("+method=sps", "draft=local", "draft.path=/no/such/draft"), "/no/such/draft"),
    Case("draft: hub offline", ("+method=sps", "draft=hub", "draft.path=pardec-tests/no-such-draft"),
         "pardec-tests/no-such-draft", env={"HF_HUB_OFFLINE": "1"}),
    # bench
    Case("bench.baseline unknown", ("+method=ar", "bench.baseline=nope"), "bench.baseline='nope'"),
    Case("bench.also unknown method", ("+method=ar", "bench.also=[nope]"), "nope"),
    Case("bench.also bad pair", ("+method=ar", "bench.also=['pld:num_pred']"), "num_pred"),
    Case("bench.also unknown param", ("+method=ar", "bench.also=['pld:numpred=3']"), "numpred"),
    Case("bench.also param type", ("+method=ar", "bench.also=['pld:num_pred=abc']"), "num_pred='abc'"),
    Case("bench.also needs a draft", ("+method=ar", "bench.also=[sps]"), "draft"),
    Case("bench.warmup=-1", ("+method=ar", "bench.warmup=-1"), "bench.warmup=-1"),
    Case("logger unknown", ("+method=ar", "logger.name=nope"), "nope"),
]




def run_cases(cases: list[Case]) -> list[tuple[int, str]]:
    """(exit code, stderr) of the CLI on each case, each in a temporary directory of its own (its ``files`` written
    there, ``{tmp}`` in its arguments naming it): one child process per distinct environment (the variables are
    read at import), through :func:`tests.evaluation.helpers.run_cli_in_one_process`."""
    results: dict[str, tuple[int, str]] = {}
    groups: dict[str, list[Case]] = {}
    for case in cases:
        groups.setdefault(json.dumps(case.env, sort_keys=True), []).append(case)
    with tempfile.TemporaryDirectory(prefix="pardec-bad-") as root:
        for env_key, group in groups.items():
            todo = []
            for c in group:
                tmp = tempfile.mkdtemp(dir=root)
                for name, content in c.files.items():
                    Path(tmp, name).write_text(content)
                # a later key=value wins, so the case's own dataset= / draft= override BASE's
                args = [*BASE, *(a.replace("{tmp}", tmp) for a in c.args), f"hydra.run.dir={tmp}/run"]
                todo.append({"args": args, "cwd": tmp})
            env = {"PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false", **json.loads(env_key)}
            for case, r in zip(group, run_cli_in_one_process(todo, PRELUDE, env), strict=True):
                results[case.name] = (r["returncode"], r["stderr"])
    return [results[c.name] for c in cases]


def judge(case: Case, code: int, err: str) -> tuple[str, str]:
    """(what is wrong with the CLI's answer, or "" when nothing is; its error line)."""
    errors = [x for x in err.splitlines() if x.startswith("error: ")]
    line = errors[0] if errors else next((x for x in reversed(err.splitlines()) if x.strip()), "")
    if code == 0:
        return "accepted (exit 0)", line
    if "Traceback (most recent call last)" in err:
        return "traceback", line
    if MARKER in (err.split(line)[0] if line else err):
        return "error after a model loaded", line
    if len(errors) != 1:
        return "not one 'error:' line", line
    if case.needle not in line:
        return f"does not name {case.needle!r}", line
    return "", line


def test_case_names_are_unique():
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.slow
def test_every_bad_input_gets_one_clear_line_before_any_model_loads():
    problems = []
    for case, (code, err) in zip(CASES, run_cases(CASES), strict=True):
        problem, line = judge(case, code, err)
        if problem:
            problems.append(f"{case.name}: {problem}: {line[:300]}")
    assert not problems, "\n".join(problems)


def test_a_case_the_cli_accepts_is_reported():
    """The judge's teeth: a valid run (exit 0) and an error naming something else are both reported."""
    ok = Case("valid", ("+method=ar",), "anything")
    assert judge(ok, 0, "")[0] == "accepted (exit 0)"
    assert judge(ok, 2, "error: max_new_tokens=0 is out of range\n")[0] == "does not name 'anything'"
    assert judge(ok, 2, f"{MARKER}\nerror: anything went wrong\n")[0] == "error after a model loaded"
    assert judge(ok, 2, "error: anything\n")[0] == ""


#: the children's first lines for the GPU recipes: any network use prints a marker and fails
NO_SOCKET = """
import socket, sys
def _refuse(*a, **k):
    print("@@pardec: the network was used@@", file=sys.stderr, flush=True)
    raise OSError("no network in this test")
socket.socket.connect = socket.socket.connect_ex = _refuse
socket.getaddrinfo = socket.create_connection = _refuse
"""


def test_every_gpu_recipe_on_a_cpu_machine_stops_in_one_line_before_the_network(tmp_path):
    """Each paper recipe (``+recipe=<name>``) and each 7B+ training experiment, on this machine without CUDA: exit 2 with one
    ``error:`` line naming the CUDA device, no traceback, and not one connection or name lookup attempted (the
    hub's offline switches unset, so a probe would show)."""
    import torch

    from pardec import plan

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is usable here: the recipes would start")
    online = {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0"}
    cases = [{"args": [f"+recipe={n}"], "cwd": tmp_path, "env": online} for n, app in plan.recipes().items()
             if app == "evaluate"]
    cases += [{"args": [f"+experiment={n}"], "cwd": tmp_path, "env": online, "app": "train"}
              for n in plan.paper_recipes() if plan.recipes()[n] == "train"]  # the 7B+ ones (pardec.plan's)
    assert len(cases) >= 20
    problems = []
    for case, r in zip(cases, run_cli_in_one_process(cases, prelude=NO_SOCKET), strict=True):
        lines = [x for x in r["stderr"].splitlines() if x.strip() and not x.startswith("[")]
        ok = (r["returncode"] == 2 and "@@pardec" not in r["stderr"] and "Traceback" not in r["stderr"]
              and len(lines) == 1 and lines[0].startswith("error:") and "CUDA" in lines[0])
        if not ok:
            problems.append(f"{case['args'][0]}: exit {r['returncode']}: {r['stderr'][-400:]}")
    assert not problems, "\n".join(problems)
