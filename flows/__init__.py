"""Prefect flows and deployments. Importing the package (before Prefect is imported) sets two defaults for this
process and the servers and runs it starts:

- Prefect's telemetry off (offline machines otherwise log an ERROR for every failed send); set
  ``PREFECT_SERVER_ANALYTICS_ENABLED=true`` to keep it on.
- Cached task results under ``$PREFECT_HOME/storage`` when ``PREFECT_HOME`` is set, as Prefect documents: Prefect
  3.7 resolves the default to ``~/.prefect/storage`` whatever ``PREFECT_HOME`` says (PrefectHQ/prefect#23046), so two
  clones, or a project and its tests, shared one cache and a run could be handed another project's checkpoints.
  ``PREFECT_RESULTS_LOCAL_STORAGE_PATH`` or ``PREFECT_LOCAL_STORAGE_PATH``, when set, win.
"""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
if os.environ.get("PREFECT_HOME"):
    os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH",
                          os.path.join(os.path.expanduser(os.environ["PREFECT_HOME"]), "storage"))
