"""asyncio glue for ``xfer.Transfer`` (``await transfer``)."""

import asyncio


def future_of(transfer):
    """An asyncio future of the running loop that settles when ``transfer`` finishes.

    The engine calls back on its own thread; the result crosses into the loop with
    ``call_soon_threadsafe``, as asyncio requires.
    """
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(exc):
        if fut.cancelled():
            return
        if exc is None:
            fut.set_result(transfer)
        else:
            fut.set_exception(exc)

    def on_done(exc):
        try:
            loop.call_soon_threadsafe(settle, exc)
        except RuntimeError:
            pass  # the loop was closed meanwhile: nobody is awaiting any more

    transfer.add_done_callback(on_done)
    return fut


async def notification_stream(engine, poll=0.25):
    """``async for note in engine.notifications()``: notifications as they arrive.

    Each wait runs in the loop's default executor (the engine's wait releases the GIL), in
    slices of ``poll`` seconds so the loop can cancel the iteration between them.
    """
    loop = asyncio.get_running_loop()
    while True:
        for note in engine.poll_notifications():
            yield note
        try:
            note = await loop.run_in_executor(None, engine.wait_notification, poll)
        except TimeoutError:
            continue
        yield note
