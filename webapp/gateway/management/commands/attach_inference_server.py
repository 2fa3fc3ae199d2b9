from django.core.management.base import BaseCommand, CommandError

from webapp.gateway.services import inference_server_register
from webapp.runs.models import Run
from webapp.runs.services import run_mark_running


class Command(BaseCommand):
    help = (
        "Register an inference server started by hand (e.g. python -m rl_core.inference.torch_engine) "
        "for a run, and mark the run running so its agents are served."
    )

    def add_arguments(self, parser):
        parser.add_argument("--run", required=True, help="Run id.")
        parser.add_argument(
            "--url", required=True, help="Server base URL, e.g. http://127.0.0.1:30000"
        )
        parser.add_argument(
            "--backend",
            default="external",
            choices=("external", "torch", "sglang", "vllm"),
            help="What the server is: vllm is spoken to through vLLM's routes; the others "
            "speak SGLang's native API (external: any server that does).",
        )

    def handle(self, *args, run, url, backend, **options):
        obj = Run.objects.filter(pk=run).first() if _is_uuid(run) else None
        if obj is None:
            raise CommandError(f"No run with id {run}.")
        if not url.startswith(("http://", "https://")):
            raise CommandError("--url must start with http:// or https://")
        server = inference_server_register(run=obj, url=url, backend=backend)
        obj = run_mark_running(run=obj, message=f"Inference server {server.url} attached by hand.")
        self.stdout.write(f"Run {obj.name} is {obj.status}; server {server.url} registered.")


def _is_uuid(value: str) -> bool:
    import uuid

    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True
