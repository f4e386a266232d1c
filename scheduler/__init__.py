"""Continuous-batching scheduler: pure logic over sequences and the block manager."""

from scheduler.output import ScheduledSequence, SchedulerOutput
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sequence import Sequence, SequenceStatus

__all__ = [
    "ScheduledSequence",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
]
