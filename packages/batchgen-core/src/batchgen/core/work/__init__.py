"""Work shared by several replicas: a batch's lines cut into shards, leased and fenced.

A single process does not use this package: it owns its batches by holding the storage folder's
lock. Replicas (a service with ``ServiceSettings.shared``) instead share a ledger in Postgres:

``shards``            the pure part: how a batch's lines are cut into shards, and the types the
                      ledger hands out (a ``Lease`` carries the epoch that fences its commits).
``intake``            the global intake's limits and decision (what every replica together may
                      hold unfinished), which the ledger applies under one lock.
``postgres_ledger``   ``PostgresShardLedger``: the shards, their leases on the database's clock,
                      and the manifest of committed output segments, in Postgres (psycopg 3).
``segment_store``     what every segment store shares: the keys (written once each), reading
                      committed bytes by range, orphans; ``open_segment_store(url)``.
``segment_files``     ``SegmentFiles``: segments as files on a filesystem every replica mounts.
``s3_segments``       ``S3Segments``: segments as objects in an S3-compatible store (obstore).
``ordered_segments``  ``InputOrder``: a batch's committed segments read in input-line order (a
                      shard at a time, sorted by the manifest's line numbers), for batches that
                      asked for it.
``shard_slots``       ``ShardSlots``: the lines a replica runs at once, shared fairly by the
                      shards it holds (a free slot goes to the one with the fewest running).
``lease_heartbeat``   ``LeaseHeartbeat``: a replica's lease renewals, sent from a thread of their
                      own with a connection of their own, so a busy event loop never makes
                      them late.
``shard_runner``      ``ShardRunner``: one replica's loop: claim (and take over what dead
                      replicas left), run lines, commit segments, renew, drop lost shards,
                      release at stop.

The function a replica runs each line with, on its served models, is above this package:
``execution.replica_lines.LineRunner``.
"""
