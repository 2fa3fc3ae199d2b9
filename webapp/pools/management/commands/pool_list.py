from django.core.management.base import BaseCommand

from webapp.pools.selectors import pool_list, pool_runs


class Command(BaseCommand):
    help = "List the inference pools: model, replicas wanted and up, status, attached runs."

    def handle(self, *args, **options):
        pools = list(pool_list())
        if not pools:
            self.stdout.write(
                "No inference pools. Create one: ./steep manage pool_create NAME --model M"
            )
            return
        self.stdout.write(f"{'name':<20} {'status':<9} {'servers':<8} {'runs':<5} base model")
        for pool in pools:
            runs = pool_runs(pool=pool).count()
            up = f"{pool.server_count}/{pool.replicas}"
            self.stdout.write(
                f"{pool.name:<20} {pool.status:<9} {up:<8} {runs:<5} {pool.base_model}"
            )
