"""Prefect flows and deployments. Importing the package turns Prefect's telemetry off for this process and the
servers it starts (offline machines otherwise log an ERROR for every failed send); set
``PREFECT_SERVER_ANALYTICS_ENABLED=true`` to keep it on."""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
