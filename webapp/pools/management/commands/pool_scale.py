from django.core.management.base import BaseCommand, CommandError

from webapp.pools.models import Pool
from webapp.pools.selectors import pool_get
from webapp.pools.services import IllegalPoolTransition, PoolInvalid, pool_scale, pool_start


class Command(BaseCommand):
    help = "Set how many servers a pool runs (starting a stopped or failed pool)."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("replicas", type=int)

    def handle(self, *args, name, replicas, **options):
        pool = pool_get(name=name)
        if pool is None:
            raise CommandError(f"No inference pool is named '{name}' (./steep manage pool_list).")
        try:
            pool = pool_scale(pool=pool, replicas=replicas)
            if pool.status in (Pool.Status.STOPPED, Pool.Status.FAILED) and replicas > 0:
                pool = pool_start(pool=pool)
        except (PoolInvalid, IllegalPoolTransition) as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"Pool {pool.name}: {pool.replicas} replica(s) wanted, {pool.status}.")
