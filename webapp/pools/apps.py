from django.apps import AppConfig


class PoolsConfig(AppConfig):
    name = "webapp.pools"
    label = "pools"
    verbose_name = "Inference pools"
