from django.conf import settings
from django.core.management.base import BaseCommand

from webapp.runs.demo import demo_bootstrap


class Command(BaseCommand):
    help = "Create (or refresh) the demo user, project, key, dataset, runs and agent, and print how to use them."

    def add_arguments(self, parser):
        parser.add_argument("--model", required=True, help="Model path or id for the demo runs.")
        parser.add_argument("--username", default="admin")
        parser.add_argument(
            "--start", action="store_true", help="Start the demo runs (needs the worker running)."
        )

    def handle(self, *args, model, username, start=False, **options):
        demo = demo_bootstrap(model=model, username=username, start=start)
        site = settings.SITE_URL
        runs = f"{site}/projects/{demo.project_id}/runs"
        self.stdout.write(
            f"""
  Steep is ready.

  Dashboard    {site}/
  Log in       {demo.username} / {demo.password}   (saved in {settings.DATA_DIR}/admin-password.txt)
  Demo runs    {runs}/{demo.run_id}/   (a dataset run: watch its reward climb)
               {runs}/{demo.online_run_id}/   (an online run: the built-in demo agent plays on it)
  API key      {demo.api_key}   (kept across restarts; saved in {demo.env_file})
  Agent        base_url = {demo.agent_base_url}

  The README's walkthrough, in another terminal:   source {demo.env_file}
"""
        )
