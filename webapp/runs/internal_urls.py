from django.urls import path

from webapp.runs import internal

urlpatterns = [
    path(f"runs/<str:run_id>/{name}", getattr(internal, name), name=f"internal-{name}")
    for name in (
        "config",
        "dataset",
        "status",
        "servers",
        "pool",
        "teacher_pool",
        "cluster",
        "metrics",
        "version",
        "checkpoints",
        "claim",
        "trained",
        "release",
        "resume",
        "episodes",
        "hint_signals",
        "events",
        "watch",
        "evals",
    )
]
