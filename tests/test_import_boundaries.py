"""Heavy or foreign modules stay off paths that must not load them.

- The web process (``django.setup()``, every module under webapp/, the ASGI app) never
  imports torch or ray.
- rl_core never imports Django; ``rl_core.config`` (shared with the web app) not even torch.
- Ray job modules under workers/ (``ray_*``, ``job*``) never import Django.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
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
    ) + ["workers.celery", "workers.tasks"]
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


def test_no_ray_job_module_imports_django():
    files = sorted(
        path for path in (ROOT / "workers").rglob("*.py") if path.name.startswith(("ray_", "job"))
    )
    if not files:
        pytest.skip("no Ray job modules (workers/ray_*.py, workers/job*.py) yet")
    offenders = {str(f.relative_to(ROOT)): django_imports(f) for f in files if django_imports(f)}
    assert offenders == {}


def test_the_static_scan_sees_nested_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from django.db import models\n    import webapp.runs\n")
    assert django_imports(sample) == {"django.db", "webapp.runs"}
