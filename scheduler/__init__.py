"""Continuous-batching scheduler: pure logic over sequences and the block manager."""

from scheduler.scheduler import ScheduledSequence, Scheduler, SchedulerConfig, SchedulerOutput
from scheduler.sequence import Sequence, SequenceStatus

__all__ = [
    "ScheduledSequence",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
]
