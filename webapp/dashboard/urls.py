from django.contrib.auth import views as auth_views
from django.urls import path

from webapp.dashboard import checkpoint_views, eval_views, feedback, views

app_name = "dashboard"

urlpatterns = [
    path("", views.home, name="home"),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("signup/", views.signup, name="signup"),
    path("projects/", views.projects, name="projects"),
    path("projects/<str:project_id>/", views.project_detail, name="project"),
    path("projects/<str:project_id>/runs/", views.runs, name="runs"),
    path("projects/<str:project_id>/runs/new/", views.run_new, name="run-new"),
    path("projects/<str:project_id>/runs/<str:run_id>/", views.run_detail, name="run"),
    path("projects/<str:project_id>/runs/<str:run_id>/again/", views.run_again, name="run-again"),
    path(
        "projects/<str:project_id>/runs/<str:run_id>/checkpoints/<str:checkpoint_id>/export/",
        views.checkpoint_export,
        name="checkpoint-export",
    ),
    path(
        "projects/<str:project_id>/runs/<str:run_id>/checkpoints/",
        checkpoint_views.run_checkpoints,
        name="run-checkpoints",
    ),
    path(
        "projects/<str:project_id>/runs/<str:run_id>/evals/",
        eval_views.run_evals,
        name="run-evals",
    ),
    path(
        "projects/<str:project_id>/runs/<str:run_id>/evals/new/",
        eval_views.eval_create,
        name="eval-create",
    ),
    path(
        "projects/<str:project_id>/runs/<str:run_id>/evals/<str:eval_id>/",
        eval_views.eval_detail,
        name="eval",
    ),
    path(
        "projects/<str:project_id>/runs/<str:run_id>/<str:action>/",
        views.run_action,
        name="run-action",
    ),
    path("projects/<str:project_id>/agents/", views.agents, name="agents"),
    path("projects/<str:project_id>/agents/<str:agent_id>/", views.agent_detail, name="agent"),
    path(
        "projects/<str:project_id>/sessions/<str:session_id>/",
        views.session_detail,
        name="session",
    ),
    path(
        "projects/<str:project_id>/sessions/<str:session_id>/feedback/",
        feedback.session_feedback,
        name="session-feedback",
    ),
    path("projects/<str:project_id>/review/", feedback.review, name="review"),
    path("projects/<str:project_id>/datasets/", views.datasets, name="datasets"),
    path(
        "projects/<str:project_id>/datasets/<str:dataset_id>/", views.dataset_detail, name="dataset"
    ),
    path("projects/<str:project_id>/keys/", views.keys, name="keys"),
    path(
        "projects/<str:project_id>/keys/<str:key_id>/revoke/", views.key_revoke, name="key-revoke"
    ),
]
