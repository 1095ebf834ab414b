"""BatchGen server: the OpenAI-compatible Batch REST API over ``batchgen.core.BatchService``."""

from batchgen.server.app import create_app
from batchgen.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
