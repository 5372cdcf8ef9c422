"""Suite-wide fixtures. ``seaweedfs_server`` / ``moto_server`` live in tests/s3_servers.py,
``gcs_server`` in tests/gcs_server.py, ``openenv_server`` (an OpenEnv environment server) in
tests/openenv_server.py.

pytest puts this directory (tests/ has no __init__.py) on sys.path before importing this file,
so the plugin module is importable as ``s3_servers`` from any working directory.
"""

from gcs_server import gcs_server  # noqa: F401  (a fixture, by name)
from openenv_server import openenv_server  # noqa: F401  (a fixture, by name)
from s3_servers import moto_server, seaweedfs_server  # noqa: F401  (fixtures, by name)
