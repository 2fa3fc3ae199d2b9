from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "webapp.accounts"
    label = "accounts"

    def ready(self):
        from webapp.accounts import schema  # noqa: F401  (registers the OpenAPI auth scheme)
