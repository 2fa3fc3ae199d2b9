from django.core.management.base import BaseCommand

from webapp.accounts.services import api_key_create, bootstrap_project


class Command(BaseCommand):
    help = "Create an API key for a project (creating the project and user if missing). The key is the last line of stdout."

    def add_arguments(self, parser):
        parser.add_argument("--project", required=True, help="Project name.")
        parser.add_argument("--user", help="Username to own the project (created if missing).")
        parser.add_argument("--name", default="cli", help="A label for the key.")

    def handle(self, *args, project, user=None, name="cli", **options):
        project_obj, user_obj = bootstrap_project(project_name=project, username=user)
        key, plaintext = api_key_create(project=project_obj, name=name, user=user_obj)
        self.stderr.write(
            f"Created key {key.prefix}… for project {project_obj.name} ({project_obj.id})."
        )
        self.stdout.write(plaintext)
