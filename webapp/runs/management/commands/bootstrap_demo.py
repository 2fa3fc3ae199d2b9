from django.conf import settings
from django.core.management.base import BaseCommand

from webapp.runs.demo import demo_bootstrap


class Command(BaseCommand):
    help = "Create (or refresh) the demo user, project, key, dataset, run and agent, and print how to use them."

    def add_arguments(self, parser):
        parser.add_argument("--model", required=True, help="Model path or id for the demo run.")
        parser.add_argument("--username", default="admin")
        parser.add_argument(
            "--start", action="store_true", help="Start the demo run (needs the worker running)."
        )

    def handle(self, *args, model, username, start=False, **options):
        demo = demo_bootstrap(model=model, username=username, start=start)
        site = settings.SITE_URL
        self.stdout.write(
            f"""
  Steep is ready.

  Dashboard   {site}/
  Log in      {demo.username} / {demo.password}   (saved in {settings.DATA_DIR}/admin-password.txt)
  Demo run    {site}/projects/{demo.project_id}/runs/{demo.run_id}/
  API key     {demo.api_key}   (shown once; a new one is made at every start)
  Agent       base_url = {demo.agent_base_url}

  from openai import OpenAI
  client = OpenAI(base_url="{demo.agent_base_url}", api_key="{demo.api_key}")
"""
        )
