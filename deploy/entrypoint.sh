#!/bin/sh
# Web container start: migrate, create the first admin from env, then serve.
set -e
python manage.py migrate --noinput
if [ -n "${STEEP_ADMIN_USERNAME:-}" ] && [ -n "${STEEP_ADMIN_PASSWORD:-}" ]; then
  python manage.py shell -c "
from webapp.accounts.services import user_get_or_create
import os
user_get_or_create(username=os.environ['STEEP_ADMIN_USERNAME'], password=os.environ['STEEP_ADMIN_PASSWORD'], is_superuser=True)
"
fi
exec "$@"
