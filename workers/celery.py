"""The Celery app. Configured from Django settings (``CELERY_*``)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

app = Celery("steep")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["workers"], related_name="tasks")
