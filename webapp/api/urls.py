from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from webapp.accounts import apis as accounts
from webapp.agents import apis as agents
from webapp.datasets import apis as datasets
from webapp.evals import apis as evals
from webapp.exports import apis as exports
from webapp.gateway import apis as sessions
from webapp.pools import apis as pools
from webapp.rewards import apis as rewards
from webapp.runs import apis as runs

urlpatterns = [
    path(
        "schema/",
        SpectacularAPIView.as_view(authentication_classes=[], permission_classes=[]),
        name="schema",
    ),
    path(
        "docs/",
        SpectacularSwaggerView.as_view(
            url_name="api:schema",
            template_name="api/swagger_ui.html",  # with a way back to the dashboard
            authentication_classes=[],
            permission_classes=[],
        ),
        name="docs",
    ),
    path("project/", accounts.ProjectDetailApi.as_view(), name="project"),
    path("keys/", accounts.KeyListApi.as_view(), name="keys"),
    path("keys/<str:key_id>/", accounts.KeyDetailApi.as_view(), name="key"),
    path("keys/<str:key_id>/revoke/", accounts.KeyRevokeApi.as_view(), name="key-revoke"),
    path("datasets/", datasets.DatasetListApi.as_view(), name="datasets"),
    path("datasets/<str:dataset_id>/", datasets.DatasetDetailApi.as_view(), name="dataset"),
    path("models/", runs.KnownModelsApi.as_view(), name="models"),
    path("runs/", runs.RunListApi.as_view(), name="runs"),
    path("runs/<str:run_id>/", runs.RunDetailApi.as_view(), name="run"),
    path("runs/<str:run_id>/start/", runs.RunStartApi.as_view(), name="run-start"),
    path("runs/<str:run_id>/stop/", runs.RunStopApi.as_view(), name="run-stop"),
    path("runs/<str:run_id>/clone/", runs.RunCloneApi.as_view(), name="run-clone"),
    path("runs/<str:run_id>/ledger/", runs.RunLedgerApi.as_view(), name="run-ledger"),
    path("runs/<str:run_id>/metrics/", runs.RunMetricsApi.as_view(), name="run-metrics"),
    path(
        "runs/<str:run_id>/checkpoints/", runs.RunCheckpointsApi.as_view(), name="run-checkpoints"
    ),
    path(
        "runs/<str:run_id>/checkpoints/<str:checkpoint_id>/",
        runs.RunCheckpointDetailApi.as_view(),
        name="run-checkpoint",
    ),
    path(
        "runs/<str:run_id>/checkpoints/<str:checkpoint_id>/export/",
        runs.RunCheckpointExportApi.as_view(),
        name="run-checkpoint-export",
    ),
    path(
        "runs/<str:run_id>/trajectories.jsonl",
        sessions.RunTrajectoriesExportApi.as_view(),
        name="run-trajectories",
    ),
    # The exact path (no trailing slash), and the slash form of the API's other routes.
    path(
        "runs/<str:run_id>/trajectories/export",
        exports.TrajectoryExportApi.as_view(),
        name="run-trajectories-export",
    ),
    path(
        "runs/<str:run_id>/trajectories/export/",
        exports.TrajectoryExportSlashApi.as_view(),
        name="run-trajectories-export-slash",
    ),
    path(
        "runs/<str:run_id>/checkpoints/<str:checkpoint_id>/download/",
        exports.CheckpointDownloadApi.as_view(),
        name="run-checkpoint-download",
    ),
    path("runs/<str:run_id>/evals/", evals.EvalListApi.as_view(), name="run-evals"),
    path("runs/<str:run_id>/evals/<str:eval_id>/", evals.EvalDetailApi.as_view(), name="run-eval"),
    path(
        "runs/<str:run_id>/evals/<str:eval_id>/examples/",
        evals.EvalExamplesApi.as_view(),
        name="run-eval-examples",
    ),
    path("pools/", pools.PoolListApi.as_view(), name="pools"),
    path("pools/<str:name>/", pools.PoolDetailApi.as_view(), name="pool"),
    path("pools/<str:name>/scale/", pools.PoolScaleApi.as_view(), name="pool-scale"),
    path(
        "pools/<str:name>/run_weights/", pools.PoolRunWeightsApi.as_view(), name="pool-run-weights"
    ),
    path("pools/<str:name>/start/", pools.PoolStartApi.as_view(), name="pool-start"),
    path("pools/<str:name>/stop/", pools.PoolStopApi.as_view(), name="pool-stop"),
    path("agents/", agents.AgentListApi.as_view(), name="agents"),
    path("agents/<str:agent_id>/", agents.AgentDetailApi.as_view(), name="agent"),
    path("sessions/", sessions.SessionListApi.as_view(), name="sessions"),
    path("sessions/<str:session_id>/", sessions.SessionDetailApi.as_view(), name="session"),
    path(
        "sessions/<str:session_id>/feedback/",
        rewards.SessionFeedbackApi.as_view(),
        name="session-feedback",
    ),
]
