"""Continuous-batching scheduler: pure logic over sequences and the block manager."""

from pagedspec.scheduler.output import ScheduledSequence, SchedulerOutput
from pagedspec.scheduler.scheduler import Scheduler, SchedulerConfig
from pagedspec.scheduler.sequence import Sequence, SequenceStatus

__all__ = [
    "ScheduledSequence",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
]
