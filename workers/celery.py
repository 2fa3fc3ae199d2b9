"""The Celery app (``celery -A workers worker -B``). Its tasks live in the Django apps
(``webapp/<app>/tasks.py``); this module only names the settings, by string, so that
workers/ imports no Django code: the settings module to load, and the ``CELERY_*``
settings to configure from. Celery's Django fix-up then sets Django up in the worker and
finds each installed app's ``tasks`` module."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

app = Celery("steep")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()  # the ``tasks`` module of every app in INSTALLED_APPS
