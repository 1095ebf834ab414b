"""Batches: the state machine, the batches being worked on, and every step of their lives.

``lifecycle`` is the only code that changes a batch's status; ``tracker`` holds the unfinished
batches and saves each change; ``starter`` indexes a batch's input and queues its lines;
``recovery`` resumes what a previous run left unfinished; ``deadline_watch``, ``progress`` and
``log`` watch and report them; ``ordering_step`` and ``output_order`` put a finished batch's files
in input order; ``retry`` and ``result_merge`` make retries of what failed and the merged view of a
batch and its retries; ``options`` checks the arguments of a new batch; ``shared_batches`` is a
batch shared by replicas as any of them answers for it (its record and its work in the ledger).
"""
