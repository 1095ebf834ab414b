"""Running admitted requests: each line becomes a backend request and ends as exactly one line.

``executor`` runs what the scheduler admits and writes each outcome; ``line_requests`` turns a
decoded line into the ``GenerationRequest`` its model's backend runs; ``result_cache`` and
``result_cache_keys`` replay the answers of deterministic requests seen before.
"""
