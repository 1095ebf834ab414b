"""Scheduling: the intake pool, the scheduling pool and the scheduler, in one vocabulary.

- the **intake pool** (``IntakePool``) queues accepted requests as small entries (batch, line,
  offset, length), never bodies, and hands them out in turn across tenants, and within a
  tenant earliest deadline first (``deadline_turns``);
- the **scheduling pool** (``SchedulingPool``) counts the slots in which admitted requests run;
- the **scheduler** (``Scheduler``) moves requests from the intake pool into free slots and runs
  them, releasing each slot however its request ends.
"""

from batchgen.core.scheduling.intake_pool import IntakeEntry, IntakePool
from batchgen.core.scheduling.scheduler import Finished, GroupRunner, RequestRunner, Scheduler
from batchgen.core.scheduling.scheduling_pool import SchedulingPool

__all__ = [
    "Finished",
    "GroupRunner",
    "IntakeEntry",
    "IntakePool",
    "RequestRunner",
    "Scheduler",
    "SchedulingPool",
]
