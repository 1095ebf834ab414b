"""One request line: what it may hold, per endpoint, and the shape of its answer.

``schema`` reads and checks a line and its body (bounded by ``json_bounds`` before anything
decodes it; ``json_escapes``, ``sampling_ranges`` and ``structured_output`` word what is wrong);
``parameters`` resolves sampling parameters; ``responses_api`` and ``embeddings_api`` hold what is
particular to those endpoints; ``prefix_keys`` says what a prompt prefix is; ``results`` builds the
output and error lines, and ``line_outcomes`` says which of them record a failure. Nothing here
runs a model or touches storage.
"""
