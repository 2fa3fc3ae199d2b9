"""The Celery app (``celery -A workers worker -B``). Its tasks live in the Django apps
(``webapp/<app>/tasks.py``); this module only names the settings, by string, so that
workers/ imports no Django code: the settings module to load, and the ``CELERY_*``
settings to configure from. Celery's Django fix-up then sets Django up in the worker and
finds each installed app's ``tasks`` module."""

import os
import warnings

from celery import Celery
from celery.exceptions import SecurityWarning

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

# Celery warns at every start of a worker run as root (a container, a laptop's root shell):
# a message deserialised with pickle could run code as root. With pickle accepted it refuses
# to start instead; Steep's worker accepts JSON only (CELERY_ACCEPT_CONTENT), so the warning
# is left with nothing to act on.
warnings.filterwarnings(
    "ignore", "You're running the worker with superuser privileges", SecurityWarning
)

app = Celery("steep")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()  # the ``tasks`` module of every app in INSTALLED_APPS
