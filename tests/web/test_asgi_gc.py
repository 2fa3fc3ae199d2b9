"""The web process keeps what it loaded at start-up out of the garbage collector's full passes
(``webapp/asgi.py``): walking those ~115k long-lived objects stalled every in-flight request
for ~85 ms, one to two times a second under load (docs/benchmarks/gateway.md, session 13)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import gc
import webapp.asgi
frozen = gc.get_freeze_count()
gc.collect()
print(frozen, gc.get_freeze_count())
"""


def test_the_asgi_app_freezes_its_start_up_objects(tmp_path):
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="webapp.settings", DATA_DIR=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    frozen, still_frozen = result.stdout.split()
    # Django and the apps alone are tens of thousands of objects; a full collection after
    # the import leaves them frozen.
    assert int(frozen) > 20_000, frozen
    assert int(still_frozen) == int(frozen)
