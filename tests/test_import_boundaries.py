"""Heavy or foreign modules stay off paths that must not load them.

- The web process (``django.setup()``, every module under webapp/, the ASGI app) never
  imports torch or ray.
- rl_core never imports Django; ``rl_core.config`` (shared with the web app) not even torch.
- No module under workers/ imports Django or webapp, or names one of their modules. The one
  exception is the Celery app's settings hook: workers/celery.py names the settings by
  string, ``"webapp.settings"`` and ``"django.conf:settings"``, and nothing else of them; it
  imports only celery and the standard library.
- The top-level packages webapp, rl_core and workers import each other without a circle;
  rl_core imports neither of the others.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def loaded_after(code: str, *, django: bool) -> set[str]:
    env = dict(os.environ)
    if django:
        env["DJANGO_SETTINGS_MODULE"] = "webapp.settings"
        env.setdefault("DATA_DIR", str(ROOT / "data"))
    else:
        env.pop("DJANGO_SETTINGS_MODULE", None)
    script = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


def top_level(modules: set[str]) -> set[str]:
    return {name.partition(".")[0] for name in modules}


def test_web_process_does_not_import_torch_or_ray():
    code = """
import django
django.setup()
import webapp.urls, webapp.asgi
from django.urls import get_resolver
get_resolver().url_patterns
"""
    loaded = top_level(loaded_after(code, django=True))
    assert "webapp" in loaded and "django" in loaded
    assert "torch" not in loaded
    assert "ray" not in loaded


def test_no_webapp_module_imports_torch_or_ray():
    modules = sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in (ROOT / "webapp").rglob("*.py")
        if path.name != "__init__.py" and "migrations" not in path.parts
    ) + ["workers.celery"]
    assert {"webapp.runs.tasks", "webapp.gateway.tasks"} <= set(modules)  # the worker's tasks
    code = "import django\ndjango.setup()\nimport importlib\n" + "\n".join(
        f"importlib.import_module({name!r})" for name in modules
    )
    loaded = top_level(loaded_after(code, django=True))
    assert "torch" not in loaded
    assert "ray" not in loaded


def test_rl_core_config_imports_neither_torch_nor_django():
    loaded = top_level(loaded_after("import rl_core.config", django=False))
    assert "rl_core" in loaded
    assert "torch" not in loaded
    assert "django" not in loaded


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (also inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def django_imports(path: Path) -> set[str]:
    return {m for m in imported_modules(path) if m.partition(".")[0] in {"django", "webapp"}}


def test_no_rl_core_file_imports_django():
    files = sorted((ROOT / "rl_core").rglob("*.py"))
    assert files
    offenders = {str(f.relative_to(ROOT)): django_imports(f) for f in files if django_imports(f)}
    assert offenders == {}


def test_no_workers_module_imports_django_or_webapp():
    files = sorted((ROOT / "workers").rglob("*.py"))
    assert ROOT / "workers" / "ray_job.py" in files
    offenders = {str(f.relative_to(ROOT)): django_imports(f) for f in files if django_imports(f)}
    assert offenders == {}


def module_strings(path: Path) -> set[str]:
    """String constants that name a Django or webapp module (``"webapp.settings"``, ``"django.conf:settings"``)."""
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.partition(":")[0].partition(".")[0] in {"django", "webapp"}
    }


def test_only_the_celery_app_names_the_django_settings_and_only_them():
    named = {
        str(f.relative_to(ROOT)): module_strings(f)
        for f in sorted((ROOT / "workers").rglob("*.py"))
        if module_strings(f)
    }
    assert named == {"workers/celery.py": {"webapp.settings", "django.conf:settings"}}
    celery_app = ROOT / "workers" / "celery.py"
    assert top_level(imported_modules(celery_app)) <= {"celery", *sys.stdlib_module_names}


PACKAGES = ("webapp", "rl_core", "workers")


def package_imports(root: Path = ROOT) -> dict[str, set[str]]:
    """Which of the other top-level packages each one imports (any file, at any depth)."""
    graph = {}
    for package in PACKAGES:
        imported = set()
        for path in (root / package).rglob("*.py"):
            imported |= top_level(imported_modules(path))
        graph[package] = (imported & set(PACKAGES)) - {package}
    return graph


def test_top_level_packages_import_each_other_without_a_circle():
    graph = package_imports()
    assert graph["rl_core"] == set(), graph
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as exc:
        raise AssertionError(f"import circle between packages: {exc.args[1]} in {graph}") from None


def test_the_package_scan_sees_a_circle_through_nested_imports(tmp_path):
    for package in PACKAGES:
        (tmp_path / package / "sub").mkdir(parents=True)
    (tmp_path / "webapp" / "sub" / "a.py").write_text("def f():\n    from workers import b\n")
    (tmp_path / "workers" / "b.py").write_text("import webapp.sub.a\nimport rl_core\n")
    graph = package_imports(tmp_path)
    assert graph == {"webapp": {"workers"}, "workers": {"webapp", "rl_core"}, "rl_core": set()}
    with pytest.raises(CycleError):
        TopologicalSorter(graph).prepare()


def test_the_static_scan_sees_nested_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from django.db import models\n    import webapp.runs\n")
    assert django_imports(sample) == {"django.db", "webapp.runs"}
