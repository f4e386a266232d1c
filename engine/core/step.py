"""The synchronous step: schedule, run, commit.

``Scheduler.schedule`` picks sequences and reserves their KV slots (``spec.lookahead`` draft
slots each) → ``spec.prepare`` lays out the spans → the runner runs them in one packed batch →
``spec.verify`` samples (and verifies drafts) → ``StepCommit`` commits each sample's tokens.

Nothing moves before the commit: if the forward or sampling raises, the step finds the
request(s) that fail on their own and aborts them (their outputs carry the error); the others
run next step as if nothing happened.
"""

from __future__ import annotations

from pagedspec.engine.core.commit import StepCommit
from pagedspec.engine.outputs import RequestOutput
from pagedspec.engine.sample.round import NoSpeculation, Round, Verified
from pagedspec.engine.worker.model_runner import ModelRunner
from pagedspec.engine.worker.tp_group import DistributedRunner, WorkerError
from pagedspec.scheduler import ScheduledSequence, Scheduler, SchedulerOutput


class Step:
    """One synchronous step over the engine's parts; owns the round object (``spec``)."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner | DistributedRunner,
        spec: NoSpeculation,
        commit: StepCommit,
    ) -> None:
        self.scheduler, self.runner, self.spec, self.commit = scheduler, runner, spec, commit

    def __call__(self) -> list[RequestOutput]:
        scheduler = self.scheduler
        busy = len(scheduler.running) + len(scheduler.waiting)
        sched = scheduler.schedule(self.spec.lookahead(busy))
        for seq in sched.preempted:
            self.spec.reset(seq.owner)
        if sched.is_empty:
            return []
        try:
            round, verified = self.execute(sched)
        except WorkerError:  # no request is at fault: the engine itself is gone
            raise
        except Exception as error:  # noqa: BLE001 - isolated below, or re-raised
            return self._isolate_failure(sched, error)
        return self.commit(self.spec, round, verified)

    def execute(self, sched: SchedulerOutput) -> tuple[Round, Verified]:
        """Draft, forward, sample and verify; changes no sequence, request or drafter state."""
        self.runner.copy_blocks(sched.blocks_to_copy)
        round = self.spec.prepare(sched)
        output = self.runner.forward(
            round.spans, return_hidden=round.return_hidden, hidden_layers=round.hidden_layers
        )
        return round, self.spec.verify(round, output)

    def _isolate_failure(self, sched: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """Re-run each request's part of the failed step on its own (committing nothing) and
        abort those that fail alone; if none does, re-raise: every request is as it was."""
        by_request: dict[str, list[ScheduledSequence]] = {}
        for s in sched.scheduled:
            by_request.setdefault(s.seq.owner.request.request_id, []).append(s)
        outputs = []
        for scheduled in by_request.values():
            try:
                self.execute(SchedulerOutput(scheduled))
            except WorkerError:
                raise
            except Exception as own_error:  # noqa: BLE001 - this request is the culprit
                outputs.append(self.commit.abort(scheduled[0].seq.owner.request, own_error))
        if not outputs:
            raise error
        return outputs
