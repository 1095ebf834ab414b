"""Storage: the protocols (``interfaces``) and today's implementation of them.

- ``SQLiteMetadataStore``: files, batches and idempotency keys in SQLite;
- ``LocalBlobStore``: file contents under the storage path;
- ``OutputWriter``: append-only result files, and ``read_finished_lines`` to read them back;
- ``postgres_metadata.PostgresMetadataStore``: the same metadata in PostgreSQL (the ``postgres``
  extra; imported from its module, so the package loads without psycopg);
- ``object_blobs.ObjectBlobStore``: uploaded files as objects in an S3-compatible store, read
  through local copies (the ``s3`` extra; imported from its module), and ``s3_objects``, which
  makes an ``s3://`` URL an obstore client;
- ``metadata_calls.MetadataCalls``: how the service calls a metadata store (in place, or in worker
  threads for one across a network);
- ``metadata_rows``: the rows both metadata stores keep, and their mapping to the models;
- ``metadata_queries``: the SQL both stores run alike, built for each driver's placeholder;
- ``durable_folders.sync_folder``: fsync a folder, so a file created or renamed in it survives a crash.
"""

from batchgen.core.storage.interfaces import BlobStore, IdempotencyRecord, MetadataStore, ResultWriter
from batchgen.core.storage.local_blobs import LocalBlobStore
from batchgen.core.storage.result_files import FinishedLines, OutputWriter, read_finished_lines
from batchgen.core.storage.sqlite_metadata import SQLiteMetadataStore

__all__ = [
    "BlobStore",
    "FinishedLines",
    "IdempotencyRecord",
    "LocalBlobStore",
    "MetadataStore",
    "OutputWriter",
    "ResultWriter",
    "SQLiteMetadataStore",
    "read_finished_lines",
]
