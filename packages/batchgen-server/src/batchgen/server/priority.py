"""The API side yields the CPU to the model: ``lower_api_priority`` lowers the server's priority.

When cores are scarce (two, say), the HTTP side (the event loop answering polls, JSON, logging)
competes with the model for them. The model's work comes first: once the service has started
(and with it any model worker process), the server lowers its own priority as ``--api-nice``
says.

- ``auto`` (the default) is ``idle`` when a served model computes on this machine's CPU in a
  worker process of its own (the transformers backend without a GPU), where the model and the API
  compete for the same cores, and 10 otherwise: a GPU model, an upstream server, the simulated
  backend, and the embeddings backend, whose model runs on a thread of the server that the event
  loop feeds (at ``SCHED_IDLE`` the loop would starve its own model).
- A number from 1 to 19 raises the nice value by that much: with the model wanting
  every core, the scheduler gives the API a small share of the CPU (about a tenth of one torch
  thread's at +10), so a client polling in a tight loop waits for its answers instead of taking
  a core. Along with it the API asks for a short scheduler slice (``API_SLICE_NS``; Linux 6.12
  and later honour it through ``sched_setattr``, older kernels ignore it): a woken API thread is
  then picked soon, so an occasional poll is answered quickly even though the API's share is
  small.
- ``idle`` takes Linux's ``SCHED_IDLE`` policy instead, below even nice 19: the API runs only on
  CPU time the model leaves, so polls may wait for a busy model's next pause (up to a second or
  two on a CPU-bound model: ``benchmarks/polling.py`` and ``responsiveness.py`` measure both sides). Where ``SCHED_IDLE`` does not exist, it means +19.
- 0 leaves the priority alone.

On Linux the policy, nice value and slice belong to each thread, and a new thread or process
inherits its creator's: the change applies to the thread running the app (the event loop) and to
everything it starts from then on, not to threads started before it, such as the transformers
backend's supervisor thread, which reads the worker's results and heartbeats and starts its
worker processes (so a restarted worker keeps the priority the first one had). Nothing can undo
the change without privileges, so it is made once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from typing import Literal

logger = logging.getLogger("batchgen.server")

#: ``--api-nice idle``: the API runs only on CPU time the model leaves (``SCHED_IDLE``).
IDLE: Literal["idle"] = "idle"
#: ``--api-nice auto``: ``idle`` when a model computes on the CPU in a worker process, else
#: ``AUTO_NICE``.
AUTO: Literal["auto"] = "auto"
AUTO_NICE = 10
ApiNice = int | Literal["idle", "auto"]

#: The scheduler slice the API asks for with its lower priority: short, so that a woken API
#: thread runs soon; its share of a busy CPU stays what the nice value gives it.
API_SLICE_NS = 100_000

#: ``sched_setattr``'s system call number where it is known.
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}.get(platform.machine())


class _SchedAttr(ctypes.Structure):
    """``struct sched_attr`` (linux/sched/types.h)."""

    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
        ("sched_util_min", ctypes.c_uint32),
        ("sched_util_max", ctypes.c_uint32),
    ]


def parse_api_nice(text: str) -> ApiNice:
    """``auto``, ``idle`` or a nice increment from 0 to 19."""
    word = text.strip().lower()
    if word in (AUTO, IDLE):
        return AUTO if word == AUTO else IDLE
    value = int(text)
    if not 0 <= value <= 19:
        raise ValueError(f"must be 'auto', 'idle' or a number from 0 to 19, got {value}")
    return value


def resolve_api_nice(setting: ApiNice, cpu_worker: bool) -> int | Literal["idle"]:
    """What ``auto`` means here: ``idle`` when a served model computes on the CPU in a worker
    process (``cpu_worker``), else 10."""
    if setting == AUTO:
        return IDLE if cpu_worker else AUTO_NICE
    return setting


def lower_api_priority(setting: int | Literal["idle"]) -> str | None:
    """Lower the calling thread's priority as ``setting`` says (0: leave it); what it now runs
    at ("SCHED_IDLE", "nice 10"), or None when nothing changed."""
    if setting == IDLE:
        if hasattr(os, "SCHED_IDLE"):
            try:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            except OSError as exc:
                logger.warning("could not move the API to SCHED_IDLE (%s); raising its nice value", exc)
            else:
                logger.info("the API runs at SCHED_IDLE so that the model's work comes first on a busy CPU")
                return "SCHED_IDLE"
        setting = 19
    assert isinstance(setting, int)
    if setting <= 0:
        return None
    target = min(os.nice(0) + setting, 19)
    if not _set_nice_and_slice(target, API_SLICE_NS):
        try:
            target = os.nice(setting)
        except OSError as exc:  # a platform or sandbox without it: serve anyway, at the same priority
            logger.warning("could not lower the API's priority (nice +%d): %s", setting, exc)
            return None
    logger.info("the API runs at nice %d so that the model's work comes first on a busy CPU", target)
    return f"nice {target}"


def _set_nice_and_slice(nice: int, slice_ns: int) -> bool:
    """Give the calling thread the normal policy at ``nice`` with a ``slice_ns`` scheduler slice
    (``sched_setattr``); False where that call is not available or refused."""
    if _SCHED_SETATTR is None or not hasattr(os, "SCHED_OTHER"):
        return False
    attributes = _SchedAttr(
        size=ctypes.sizeof(_SchedAttr), sched_policy=os.SCHED_OTHER, sched_nice=nice, sched_runtime=slice_ns
    )
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SCHED_SETATTR, 0, ctypes.byref(attributes), 0) == 0
    except (OSError, AttributeError):
        return False
