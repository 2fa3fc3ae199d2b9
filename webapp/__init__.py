# Load the Celery app with Django so that ``task.delay()`` in the web process uses
# Steep's broker settings rather than Celery's default app (amqp://localhost).
from workers.celery import app as celery_app

__all__ = ("celery_app",)
