from django.apps import AppConfig


class RewardsConfig(AppConfig):
    name = "webapp.rewards"
    default_auto_field = "django.db.models.BigAutoField"
