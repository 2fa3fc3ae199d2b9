"""ASGI entry point: HTTP (dashboard, REST API, gateway) and websockets (live run metrics)."""

import gc
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from rl_core import tracing  # noqa: E402
from webapp.gateway.asgi import fast_route  # noqa: E402
from webapp.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": fast_route(django_asgi_app),
        "websocket": AuthMiddlewareStack(URLRouter(websocket_urlpatterns)),
    }
)

# OpenTelemetry traces of agent turns when OTEL_* asks for them (docs/metrics.md, "Traces").
tracing.setup("steep-web")

# Everything loaded so far (Django, the apps, their modules) lives as long as the process:
# kept out of the garbage collector's full passes, which otherwise walk ~115k such objects
# and stalled every request for ~85 ms at a time, 1-2 times a second under load (p99 of the
# sessions benchmark 20-30% lower with this, docs/benchmarks.md). What requests allocate is
# collected as before.
gc.collect()
gc.freeze()
