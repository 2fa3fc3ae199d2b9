"""The Ray side of Steep, free of Django: the run's Ray job (``ray_job``), its client of the
web app's internal API (``job_api``), the cluster helpers the web app uses to submit and
watch jobs (``ray_cluster``), and the Celery app object (``celery``: ``celery -A workers
worker -B``), whose tasks live in the Django apps.

Kept empty on purpose: Ray job modules must not load Django or Celery, so the Celery app
is in ``workers.celery`` (Celery finds it from ``-A workers``).
"""
