"""Running admitted requests: each line becomes a backend request and ends as exactly one line.

``executor`` runs what the scheduler admits and writes each outcome; ``line_requests`` checks a
decoded line's body and model and turns it into the ``GenerationRequest`` its model's backend
runs; ``replica_lines`` runs one line of a batch shared by replicas and answers with its line;
``result_cache`` and ``result_cache_keys`` replay the answers of deterministic requests seen before.
"""
