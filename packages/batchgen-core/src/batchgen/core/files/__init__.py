"""Files: uploads, the catalogue of files and their contents, and batch input files.

``catalogue`` records uploaded and result files; ``batch_file`` checks and indexes a batch input
file, and ``streamed_validation`` does so as the bytes arrive; ``chunked_uploads``,
``upload_parts`` and ``upload_validation_worker`` are the Uploads API; ``write_behind`` writes
large files without growing the page cache; ``line_blocks`` reads lines back in blocks;
``batch_inputs`` reads a batch's lines by number for a replica that did not start the batch.
"""
