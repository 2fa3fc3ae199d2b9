"""Steep settings. Everything comes from the environment (see deploy/.env.example).

No DATABASE_URL → SQLite in DATA_DIR; no REDIS_URL → in-memory channel layer and an
embedded file-system Celery broker under DATA_DIR that works across processes.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured

from rl_core.tracker_specs import parse_instance_trackers
from webapp.env import database_from_url, envbool, envint, envlist, envsecret, envstr

BASE_DIR = Path(__file__).resolve().parent.parent

DEBUG = envbool("DEBUG", True)
DATA_DIR = Path(envstr("DATA_DIR", str(BASE_DIR / "data"))).resolve()
DATA_DIR.mkdir(parents=True, exist_ok=True)

SECRET_KEY = envsecret("SECRET_KEY")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured(
            "SECRET_KEY is required when DEBUG is off; set SECRET_KEY (or SECRET_KEY_FILE) to a long random string."
        )
    SECRET_KEY = "steep-insecure-development-key-set-SECRET_KEY-in-production"

SITE_URL = envstr("SITE_URL", "http://127.0.0.1:8000").rstrip("/")
ALLOWED_HOSTS = envlist(
    "ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]", "testserver"] if DEBUG else []
)
if not DEBUG and not ALLOWED_HOSTS:
    raise ImproperlyConfigured(
        "ALLOWED_HOSTS is required when DEBUG is off; set it to the comma-separated host names "
        "Steep is reached at, e.g. ALLOWED_HOSTS=steep.example.com (the host of SITE_URL)."
    )
CSRF_TRUSTED_ORIGINS = envlist("CSRF_TRUSTED_ORIGINS", []) or [SITE_URL]

# Behind a reverse proxy that terminates TLS and sets X-Forwarded-Proto: secure cookies,
# HTTPS redirects and HSTS. Probes (/healthz, /readyz) never reach the redirect (see
# webapp.health) and the internal API is reached over the cluster network by Ray jobs.
BEHIND_TLS_PROXY = envbool("BEHIND_TLS_PROXY", False)
if BEHIND_TLS_PROXY:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = True
    SECURE_REDIRECT_EXEMPT = [r"^healthz/?$", r"^readyz/?$", r"^internal/"]
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = envint("SECURE_HSTS_SECONDS", 31_536_000, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = envbool("SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
    SECURE_HSTS_PRELOAD = envbool("SECURE_HSTS_PRELOAD", False)
# Joining the browsers' HSTS preload list is the operator's own decision, made elsewhere.
SILENCED_SYSTEM_CHECKS = ["security.W021"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's files, served from here: /api/v1/docs/ works offline
    "channels",
    "django_htmx",
    "webapp.accounts",
    "webapp.datasets",
    "webapp.runs",
    "webapp.pools",
    "webapp.agents",
    "webapp.gateway",
    "webapp.rewards",
    "webapp.evals",
    "webapp.dashboard",
    "webapp.metrics",  # /metrics (Prometheus); its tasks module: the worker's metrics
]

MIDDLEWARE = [
    "webapp.observability.request_id_middleware",
    "webapp.health.health_middleware",
    "webapp.metrics.views.metrics_middleware",  # /metrics, like the probes: before host checks
    "webapp.middleware.BodySizeLimitMiddleware",
    "webapp.middleware.DatabaseUnavailableMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "webapp.static_files.StaticFilesMiddleware",  # WhiteNoise, streamed as ASGI wants
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
]

ROOT_URLCONF = "webapp.urls"
ASGI_APPLICATION = "webapp.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "webapp.dashboard.context.site",
            ],
        },
    },
]

DATABASE_URL = envsecret("DATABASE_URL")
if DATABASE_URL:
    DATABASES = {"default": database_from_url(DATABASE_URL)}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": DATA_DIR / "steep.sqlite3",
            "OPTIONS": {
                "timeout": 30,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL;",
            },
        }
    }
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # A file (not :memory:) so that worker processes started by tests see the test database.
    DATABASES["default"]["TEST"] = {"NAME": str(DATA_DIR / "test.sqlite3")}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {
        "NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
        "OPTIONS": {"min_length": 8},
    },
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "dashboard:login"
LOGIN_REDIRECT_URL = "dashboard:projects"
LOGOUT_REDIRECT_URL = "dashboard:login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = envstr("TIME_ZONE", "UTC")
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "staticfiles"
STATIC_ROOT.mkdir(exist_ok=True)  # whitenoise warns on every start when it is missing
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True
# The docs site: mkdocs.yml builds docs/ into it (./steep up and the image do), served at /docs/.
DOCS_SITE_DIR = BASE_DIR / "site"

# Request bodies. Datasets have their own, larger limit; everything else is JSON.
MAX_REQUEST_BYTES = envint("MAX_REQUEST_BYTES", 16 * 1024 * 1024, minimum=1024)
DATASET_MAX_BYTES = envint("DATASET_MAX_BYTES", 200 * 1024 * 1024, minimum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BYTES
FILE_UPLOAD_MAX_MEMORY_SIZE = 2 * 1024 * 1024

# Gateway
SESSION_IDLE_TIMEOUT_S = envint("SESSION_IDLE_TIMEOUT_S", 1800, minimum=1)
GATEWAY_RETRY_AFTER_S = envint("GATEWAY_RETRY_AFTER_S", 2, minimum=1)
GATEWAY_MAX_NEW_TOKENS = envint("GATEWAY_MAX_NEW_TOKENS", 4096, minimum=1)

# Per-key request rates (webapp.ratelimit): 0 = off. Over the limit: 429 + Retry-After.
RATE_LIMIT_API_PER_MIN = envint("RATE_LIMIT_API_PER_MIN", 0, minimum=0)
RATE_LIMIT_GATEWAY_PER_MIN = envint("RATE_LIMIT_GATEWAY_PER_MIN", 0, minimum=0)

# Training jobs (Ray)
RAY_ADDRESS = envstr("RAY_ADDRESS", "")
RAY_LOCAL_DASHBOARD_PORT = envint("RAY_LOCAL_DASHBOARD_PORT", 8265, minimum=1)
RAY_LOCAL_GCS_PORT = envint("RAY_LOCAL_GCS_PORT", 7379, minimum=1)
RAY_NUM_CPUS = envint("RAY_NUM_CPUS", 0, minimum=0)
# GPUs reserved for a run's job driver, which hosts the trainer: > 0 places it on a GPU node.
RAY_JOB_NUM_GPUS = envint("RAY_JOB_NUM_GPUS", 0, minimum=0)
# The URL a run's job uses to reach this web app's internal API (defaults to SITE_URL).
INTERNAL_API_URL = envstr("INTERNAL_API_URL", "") or SITE_URL
if INTERNAL_API_URL != SITE_URL and urlsplit(INTERNAL_API_URL).hostname:
    ALLOWED_HOSTS.append(urlsplit(INTERNAL_API_URL).hostname)  # e.g. http://web:8000 in compose
# Networks allowed to call /internal/ (empty: any; the per-run job secret is required anyway).
INTERNAL_API_ALLOWED_CIDRS = envlist("INTERNAL_API_ALLOWED_CIDRS", [])
for _cidr in INTERNAL_API_ALLOWED_CIDRS:
    try:
        ipaddress.ip_network(_cidr, strict=False)
    except ValueError:
        raise ImproperlyConfigured(
            f"INTERNAL_API_ALLOWED_CIDRS: {_cidr!r} is not a network; use e.g. 10.0.0.0/8,172.16.0.0/12."
        ) from None
# The Celery worker's own /metrics (webapp.metrics.tasks) on this port, on every interface, to
# INTERNAL_API_ALLOWED_CIDRS like /internal/ and the web's /metrics. 0: not served.
WORKER_METRICS_PORT = envint("WORKER_METRICS_PORT", 0, minimum=0)
if WORKER_METRICS_PORT > 65535:
    raise ImproperlyConfigured(
        f"WORKER_METRICS_PORT={WORKER_METRICS_PORT} is not a TCP port; use 1-65535, or 0 for none."
    )
# How long the internal API holds a run job's claim (and status watch) request while there is
# nothing new to answer: an idle run asks a few times a minute (webapp.runs.internal). 0: never.
INTERNAL_API_LONG_POLL_S = envint("INTERNAL_API_LONG_POLL_S", 30, minimum=0)
# Relaunches of a run whose job crashed, since it was last started by hand (a run interrupted
# by a clean stop of Steep resumes without using one).
RUN_MAX_RESTARTS = envint("RUN_MAX_RESTARTS", 3, minimum=0)
# How often the worker looks for runs whose job died (and restarts them): the longest a
# crashed run waits before its restart is queued.
RUN_RECONCILE_INTERVAL_S = envint("RUN_RECONCILE_INTERVAL_S", 15, minimum=1)
# torch threads per inference server / trainer process in a run's job.
STEEP_TORCH_THREADS = envint("STEEP_TORCH_THREADS", 1, minimum=1)
# How long a run's trainer workers wait for free GPUs (CPUs) before the run fails.
STEEP_PLACEMENT_TIMEOUT_S = envint("STEEP_PLACEMENT_TIMEOUT_S", 600, minimum=1)
# The bound on every step of a weight update (group join, broadcast, load): a server that
# misses it is reported and takes weights from disk from then on (rl_core.weight_sync).
STEEP_WEIGHT_SYNC_TIMEOUT_S = envint("STEEP_WEIGHT_SYNC_TIMEOUT_S", 120, minimum=1)
# Judge rewards (webapp.rewards): how often the worker looks for sessions to judge, and at
# most how many judge calls one worker makes at once (a thread pool, off any event loop).
STEEP_JUDGE_INTERVAL_S = envint("STEEP_JUDGE_INTERVAL_S", 10, minimum=1)
# A running eval's worker writes a heartbeat this often; one silent for four of them (its
# worker was killed) is queued again, up to EVAL_MAX_ATTEMPTS starts (webapp/evals).
EVAL_HEARTBEAT_S = envint("EVAL_HEARTBEAT_S", 15, minimum=1)
EVAL_MAX_ATTEMPTS = envint("EVAL_MAX_ATTEMPTS", 3, minimum=1)
STEEP_JUDGE_CONCURRENCY = envint("STEEP_JUDGE_CONCURRENCY", 4, minimum=1)
# Chaos tests only: a file of failpoints where a run's trainer kills itself (rl_core.failpoints).
STEEP_FAILPOINTS = envstr("STEEP_FAILPOINTS", "")

# The demo `./steep up` sets up: its model (offered first as a run's base_model) and the
# demo agent that keeps its online run busy (webapp.runs.demo_agent).
STEEP_DEMO_MODEL = envstr("STEEP_DEMO_MODEL", "") or str(DATA_DIR / "models" / "tiny-chat")
STEEP_DEMO_AGENT = envbool("STEEP_DEMO_AGENT", True)

# What a run's settings may make the server read, import and call (rl_core.sources; docs/
# operations.md, "What a project may name"). Models: directories under these roots (a bare
# name is looked up in each) and the demo model; Hugging Face ids only with STEEP_HUB_MODELS,
# downloaded into the models directory's hub cache.
STEEP_MODEL_ROOTS = [
    str(Path(root).expanduser().resolve())
    for root in envlist("STEEP_MODEL_ROOTS", [str(DATA_DIR / "models")])
]
STEEP_HUB_MODELS = envbool("STEEP_HUB_MODELS", False)
if STEEP_HUB_MODELS:  # the web process reads their tokenizers: from the same cache as the jobs
    os.environ.setdefault("HF_HUB_CACHE", str(DATA_DIR / "models" / "hub"))
# Module prefixes whose functions a python reward may name (Steep's own rewards always may).
STEEP_REWARD_MODULES = envlist("STEEP_REWARD_MODULES", [])
for _module in STEEP_REWARD_MODULES:
    if not all(part.isidentifier() for part in _module.split(".")):
        raise ImproperlyConfigured(
            f"STEEP_REWARD_MODULES: {_module!r} is not a module name; use e.g. mycorp.rewards."
        )
# Experiment trackers every run mirrors to unless its `trackers` setting turns them off, and
# the credentials they use when a run gives none (docs/trackers.md).
try:
    STEEP_TRACKERS = parse_instance_trackers(envstr("STEEP_TRACKERS"))
except ValueError as _exc:
    raise ImproperlyConfigured(str(_exc)) from None
STEEP_WANDB_API_KEY = envsecret("STEEP_WANDB_API_KEY")
STEEP_MLFLOW_TRACKING_TOKEN = envsecret("STEEP_MLFLOW_TRACKING_TOKEN")
# Networks (CIDR) and host names a tenant's judge URL may reach although they are loopback,
# private, link-local or this instance's own. Embedded default (DEBUG): the loopback only.
STEEP_OUTBOUND_ALLOW = envlist(
    "STEEP_OUTBOUND_ALLOW", ["127.0.0.0/8", "::1", "localhost"] if DEBUG else []
)
for _entry in STEEP_OUTBOUND_ALLOW:
    try:
        if "/" in _entry or _entry.replace(".", "").isdigit() or ":" in _entry:
            ipaddress.ip_network(_entry, strict=False)
    except ValueError:
        raise ImproperlyConfigured(
            f"STEEP_OUTBOUND_ALLOW: {_entry!r} is neither a network nor a host name; use e.g."
            " 10.0.0.0/8,judge.internal."
        ) from None

REDIS_URL = envsecret("REDIS_URL")
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL]},
        }
    }
    CELERY_BROKER_URL = REDIS_URL
    CELERY_RESULT_BACKEND = REDIS_URL
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    _broker = DATA_DIR / "broker"
    for _sub in ("queue", "processed", "control"):
        (_broker / _sub).mkdir(parents=True, exist_ok=True)
    # kombu's file-system transport: a real broker shared by every process on this machine.
    # (The host means nothing to it; kombu warns at every connection when there is none.)
    CELERY_BROKER_URL = "filesystem://localhost//"
    # kombu's transport with messages that appear whole (workers/fs_broker.py says why)
    CELERY_BROKER_TRANSPORT = "workers.fs_broker:Transport"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker / "queue"),
        "data_folder_out": str(_broker / "queue"),
        "processed_folder": str(_broker / "processed"),
        "control_folder": str(_broker / "control"),
        "store_processed": False,
    }
    CELERY_RESULT_BACKEND = f"file://{DATA_DIR / 'broker' / 'results'}"
    (_broker / "results").mkdir(parents=True, exist_ok=True)
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ALWAYS_EAGER = envbool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_BEAT_SCHEDULE = {
    "expire-idle-sessions": {"task": "sessions.expire_idle", "schedule": 60.0},
    "reconcile-runs": {"task": "runs.reconcile", "schedule": float(RUN_RECONCILE_INTERVAL_S)},
    # Judge and human rewards (webapp/rewards): open, judge, time out; one tick at a time.
    "rewards": {
        "task": "rewards.tick",
        "schedule": float(STEEP_JUDGE_INTERVAL_S),
        "options": {"expires": float(STEEP_JUDGE_INTERVAL_S)},
    },
    "reconcile-pools": {"task": "pools.reconcile", "schedule": 15.0},
    "reconcile-evals": {"task": "evals.reconcile", "schedule": float(EVAL_HEARTBEAT_S)},
}
if STEEP_DEMO_AGENT:
    # A bounded batch of episodes per tick; a tick that finds another still playing returns.
    CELERY_BEAT_SCHEDULE["demo-agent"] = {
        "task": "runs.demo_agent",
        "schedule": 15.0,
        "options": {"expires": 15.0},
    }

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "webapp.accounts.auth.APIKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["webapp.accounts.auth.HasProject"],
    "DEFAULT_THROTTLE_CLASSES": ["webapp.api.throttling.KeyRateThrottle"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PAGINATION_CLASS": "webapp.api.pagination.Pagination",
    "PAGE_SIZE": 50,
    "EXCEPTION_HANDLER": "webapp.api.errors.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "webapp.api.schema.AutoSchema",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Steep API",
    "DESCRIPTION": (
        "[← Back to the dashboard](/) · [Documentation](/docs/)\n\n"
        "**Agent gateway** (first below): what an agent calls on its `base_url`, "
        "`/agents/{agent_id}/v1`: chat completions, responses, messages, models and the RL "
        "protocol. **REST API** (`/api/v1/`): projects, keys, datasets, runs, pools, agents and "
        "sessions. Authenticate with `Authorization: Bearer sk-steep-...`. "
        "Lists are paged: 50 items a page, follow `next`."
    ),
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SCHEMA_PATH_PREFIX": "/api/v1",
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # The agent gateway is not DRF: its endpoints are described by hand, listed first.
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "webapp.api.schema.add_agent_gateway",
    ],
    # Runs and pools both have a "status" with choices of their own: name each enum.
    "ENUM_NAME_OVERRIDES": {
        "RunStatusEnum": "webapp.runs.apis.RUN_STATUSES",
        "PoolStatusEnum": "webapp.pools.apis.POOL_STATUSES",
    },
}

# Logs: one line per record on stderr, each with the request id (webapp.observability).
# LOG_CONSOLE=quiet (./steep up) keeps stderr for warnings, errors and runs' and pools' status
# lines; LOG_FILE also gets every record (rotated), so that the quieted ones are kept.
LOG_FORMAT = envstr("LOG_FORMAT", "plain").strip().lower()
if LOG_FORMAT not in ("plain", "json"):
    raise ImproperlyConfigured(f"LOG_FORMAT={LOG_FORMAT!r} is not a log format; use plain or json.")
LOG_CONSOLE = envstr("LOG_CONSOLE", "all").strip().lower()
if LOG_CONSOLE not in ("all", "quiet"):
    raise ImproperlyConfigured(
        f"LOG_CONSOLE={LOG_CONSOLE!r} is not a console mode; use all (every record on stderr) or "
        "quiet (warnings, errors and status lines; the rest in LOG_FILE only)."
    )
LOG_FILE = envstr("LOG_FILE", "")
_log_handlers = ["console", "file"] if LOG_FILE else ["console"]
_handlers: dict[str, dict] = {
    "console": {
        "class": "logging.StreamHandler",
        "formatter": LOG_FORMAT,
        "filters": ["request_id", "console"],
    }
}
if LOG_FILE:
    Path(LOG_FILE).parent.mkdir(parents=True, exist_ok=True)
    _handlers["file"] = {
        "class": "logging.handlers.RotatingFileHandler",
        "filename": LOG_FILE,
        "maxBytes": 10_000_000,
        "backupCount": 3,
        "delay": True,
        "formatter": LOG_FORMAT,
        "filters": ["request_id"],
    }
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {
        "request_id": {"()": "webapp.observability.RequestIdFilter"},
        "console": {"()": "webapp.observability.ConsoleFilter", "quiet": LOG_CONSOLE == "quiet"},
    },
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"},
        "json": {"()": "webapp.observability.JsonFormatter"},
    },
    "handlers": _handlers,
    "root": {"handlers": _log_handlers, "level": envstr("LOG_LEVEL", "INFO")},
    "loggers": {
        "django": {"handlers": _log_handlers, "level": "INFO", "propagate": False},
        "django.db.backends": {"level": "WARNING"},
        # One access line per request: Steep's own (steep.request, with the request id), not
        # uvicorn's as well.
        "uvicorn.access": {"handlers": [], "propagate": False},
    },
}
if LOG_FORMAT == "json":
    # uvicorn's own lines in the same format.
    for _name in ("uvicorn", "uvicorn.error"):
        LOGGING["loggers"][_name] = {"handlers": _log_handlers, "level": "INFO", "propagate": False}
if LOG_FORMAT == "json" or LOG_CONSOLE == "quiet" or LOG_FILE:
    # Celery's lines through these handlers too, instead of a stderr handler of its own.
    CELERY_WORKER_HIJACK_ROOT_LOGGER = False
