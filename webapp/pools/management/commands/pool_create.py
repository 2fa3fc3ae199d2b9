from django.core.management.base import BaseCommand, CommandError

from webapp.pools.models import Pool
from webapp.pools.services import PoolInvalid, pool_create


class Command(BaseCommand):
    help = "Create a shared inference pool for one base model and start its servers."

    def add_arguments(self, parser):
        parser.add_argument("name", help="Unique name (lowercase letters, digits, dashes).")
        parser.add_argument(
            "--model",
            required=True,
            help="Base model: a model the instance offers (a directory under STEEP_MODEL_ROOTS,"
            " the demo model; a Hugging Face id with STEEP_HUB_MODELS).",
        )
        parser.add_argument("--backend", default="auto", choices=Pool.Backend.values)
        parser.add_argument("--replicas", type=int, default=1, help="Servers (default 1).")
        parser.add_argument(
            "--tensor-parallel", type=int, default=1, help="GPUs per server (default 1)."
        )
        parser.add_argument("--max-lora-rank", type=int, default=64)
        parser.add_argument("--lora-target-modules", nargs="*", default=[])
        parser.add_argument("--max-loaded-adapters", type=int, default=8)
        parser.add_argument("--max-sessions-per-run", type=int, default=0, help="0: no limit.")
        parser.add_argument("--max-requests-per-run", type=int, default=0, help="0: no limit.")
        parser.add_argument("--no-start", action="store_true", help="Create it stopped.")
        parser.add_argument(
            "--unrestricted",
            action="store_true",
            help="Take --model as it is, past the instance's model rules (an operator's choice).",
        )

    def handle(self, *args, **options):
        try:
            pool = pool_create(
                name=options["name"],
                base_model=options["model"],
                backend=options["backend"],
                replicas=options["replicas"],
                tensor_parallel=options["tensor_parallel"],
                max_lora_rank=options["max_lora_rank"],
                lora_target_modules=options["lora_target_modules"],
                max_loaded_adapters=options["max_loaded_adapters"],
                max_sessions_per_run=options["max_sessions_per_run"],
                max_requests_per_run=options["max_requests_per_run"],
                start=not options["no_start"],
                unrestricted=options["unrestricted"],
            )
        except PoolInvalid as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(
            f"Pool {pool.name}: {pool.base_model}, {pool.replicas} replica(s), {pool.status}."
        )
