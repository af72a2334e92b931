"""The README's "Contributing" bullets name the files to touch for a new method, training kind or task: these tests
fail when the code's lists drift from them (a method module the package does not import, a registered name without
its config or its docs page, a kind missing from kinds.BUILTIN)."""

from __future__ import annotations

import ast
import re

from pardec import CONF_DIR, REPO_ROOT

SRC = REPO_ROOT / "src" / "pardec"
README = (REPO_ROOT / "README.md").read_text()


def _registered(folder, decorator: str) -> dict[str, str]:
    """name -> module stem of every ``@<decorator>("name")`` under ``folder``."""
    out = {}
    for f in sorted(folder.glob("*.py")):
        for m in re.finditer(rf'@{decorator}\("([a-z0-9_]+)"', f.read_text()):
            out[m[1]] = f.stem
    return out


def test_every_method_module_is_imported_configured_and_documented():
    methods = _registered(SRC / "decoding", "register_method")
    tree = ast.parse((SRC / "decoding" / "__init__.py").read_text())
    imported = {a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "pardec.decoding"
                for a in n.names}
    assert sorted(set(methods.values()) - imported) == [], "add the module to src/pardec/decoding/__init__.py"
    assert sorted(m for m in methods if not (CONF_DIR / "method" / f"{m}.yaml").is_file()) == []
    pages = (REPO_ROOT / "docs" / "methods" / "README.md").read_text()
    assert sorted(m for m in methods if f"`{m}`" not in pages) == []
    bullet = README[README.index("- New method:"):README.index("- New experiment kind:")]
    for named in ("src/pardec/decoding/", "@register_method", "src/pardec/decoding/__init__.py", "conf/method/",
                  "docs/methods/"):
        assert named in bullet, named


def test_every_kind_is_builtin_and_configured_and_every_task_has_its_dataset_config():
    from pardec.training.kinds import BUILTIN

    kinds = {}
    for f in sorted((SRC / "training").glob("*/__init__.py")):
        kinds.update({m[1]: f.parent.name for m in re.finditer(r'@register_kind\("([a-z0-9_]+)"', f.read_text())})
    assert sorted(kinds) == sorted(BUILTIN)
    for k in kinds:
        assert (CONF_DIR / "kind" / f"{k}.yaml").is_file() and (CONF_DIR / "trainer" / f"{k}.yaml").is_file(), k
    tasks = _registered(SRC / "tasks", "register_task")
    assert sorted(t for t in tasks if not (CONF_DIR / "dataset" / f"{t}.yaml").is_file()) == []
    bullet = README[README.index("- New experiment kind:"):README.index("- New measurement:")]
    for named in ("src/pardec/training/<kind>/", "@register_kind", "conf/kind/", "conf/trainer/", "kinds.BUILTIN",
                  "src/pardec/tasks/", "@register_task", "conf/dataset/"):
        assert named in bullet, named


def test_every_drafter_type_has_a_model_and_a_training_side_and_the_readme_names_their_files():
    from pardec.models.drafter_types import BUILTIN as MODEL_MODULES
    from pardec.models.drafter_types import EXPORT_BUILTIN, drafter_types, exported_types
    from pardec.training.drafter.types import BUILTIN as TRAINING_MODULES
    from pardec.training.drafter.types import drafter_type

    models = {f"pardec.models.{f.stem}" for f in (SRC / "models").glob("*.py")
              if re.search(r'^@register_drafter\(', f.read_text(), re.M)}
    assert models == set(MODEL_MODULES), "add the module to drafter_types.BUILTIN"
    exporters = {f"pardec.models.{f.stem}" for f in (SRC / "models").glob("*.py")
                 if re.search(r'^@register_exporter\(', f.read_text(), re.M)}
    assert exporters == set(EXPORT_BUILTIN), "add the module to drafter_types.EXPORT_BUILTIN"
    assert set(exported_types()) <= set(drafter_types())
    from pardec.plan.drafters import drafter_terms

    assert all(callable(drafter_terms(name)) for name in drafter_types())  # every type has its memory-plan terms
    training = {f"pardec.training.drafter.{f.stem}" for f in (SRC / "training" / "drafter").glob("*.py")
                if "@register_drafter_type" in f.read_text()}
    assert training == set(TRAINING_MODULES), "add the module to pardec.training.drafter.types.BUILTIN"
    for name in drafter_types():  # every model type trains, and every training side has its model
        assert drafter_type(name).name == name
        assert any((CONF_DIR / "experiment").glob(f"*{name}_*.yaml")), name  # heads_<type>_ or <type>_<name>
    bullet = README[README.index("- New drafter type"):README.index("- New experiment kind:")]
    for named in ("src/pardec/models/", "@register_drafter", "drafter_types.BUILTIN", "src/pardec/training/drafter/",
                  "@register_drafter_type", "types.BUILTIN", "<type>_<name>", "load_drafter", "@register_exporter",
                  "EXPORT_BUILTIN", "src/pardec/plan/drafters/", "@plan_terms"):
        assert named in bullet, named
