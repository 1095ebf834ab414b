"""Storage: batch and file metadata (SQLite), file contents on disk, and append-only output files."""

from batchgen.core.storage.blobs import BlobStore
from batchgen.core.storage.metadata import MetadataStore
from batchgen.core.storage.output import FinishedLines, OutputWriter, read_finished_lines

__all__ = ["BlobStore", "FinishedLines", "MetadataStore", "OutputWriter", "read_finished_lines"]
