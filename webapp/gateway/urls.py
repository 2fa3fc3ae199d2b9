from django.urls import path

from webapp.gateway import views

urlpatterns = [
    path(
        "agents/<str:agent_id>/v1/chat/completions", views.chat_completions, name="chat-completions"
    ),
    path("agents/<str:agent_id>/v1/responses", views.responses, name="responses"),
    path("agents/<str:agent_id>/v1/messages", views.messages, name="messages"),
    path("agents/<str:agent_id>/v1/models", views.models, name="models"),
    path("agents/<str:agent_id>/v1/rl/start_session", views.start_session, name="start-session"),
    path("agents/<str:agent_id>/v1/rl/set_reward", views.set_reward, name="set-reward"),
    path("agents/<str:agent_id>/v1/rl/end_session", views.end_session, name="end-session"),
]
