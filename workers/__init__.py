"""Celery app and tasks (``celery -A workers worker -B``); Ray job entrypoints.

Kept empty on purpose: Ray job modules live here too and must not load Django,
so the Celery app is in ``workers.celery`` (Celery finds it from ``-A workers``).
"""
