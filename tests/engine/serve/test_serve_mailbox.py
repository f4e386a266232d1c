"""The server's per-handler mailbox: a stalled reader holds one output per request, not one per
engine step (outputs are cumulative, so each unread one held every token so far)."""

from __future__ import annotations

import asyncio

from pagedspec.engine.outputs import CompletionOutput, RequestOutput
from pagedspec.engine.serve.async_engine import OutputMailbox


def output(request_id: str, num_tokens: int, finished: bool = False) -> RequestOutput:
    tokens = list(range(num_tokens))
    choice = CompletionOutput(0, "x" * num_tokens, tokens, "length" if finished else None)
    return RequestOutput(request_id, None, [1, 2], [choice], finished)


def test_a_stalled_reader_holds_only_the_newest_output_of_each_request():
    async def run():
        mailbox = OutputMailbox()
        for step in range(1, 501):  # the engine steps 500 times; nobody reads
            mailbox.put_nowait(output("a", step, finished=step == 500))
            if step <= 300:
                mailbox.put_nowait(output("b", step, finished=step == 300))
        assert len(mailbox) == 2
        first, second = await mailbox.get(), await mailbox.get()
        assert (first.request_id, len(first.outputs[0].token_ids), first.finished) == (
            "a",
            500,
            True,
        )
        assert (second.request_id, len(second.outputs[0].token_ids), second.finished) == (
            "b", 300, True,
        )  # fmt: skip
        assert len(mailbox) == 0

    asyncio.run(run())


def test_an_error_is_read_after_the_outputs_already_there_and_get_waits():
    async def run():
        mailbox = OutputMailbox()
        reader = asyncio.ensure_future(mailbox.get())
        await asyncio.sleep(0)
        assert not reader.done()  # nothing to read yet
        mailbox.put_nowait(output("a", 1))
        assert (await reader).request_id == "a"
        mailbox.put_nowait(output("a", 2))
        mailbox.put_nowait(RuntimeError("engine step failed"))
        mailbox.put_nowait(output("a", 3))  # replaces the unread "a", keeps its place
        assert len((await mailbox.get()).outputs[0].token_ids) == 3
        assert isinstance(await mailbox.get(), RuntimeError)

    asyncio.run(run())
