"""``Work.get_future()``: a ``concurrent.futures.Future`` completed by a waiter thread."""

import concurrent.futures
import threading


def future_of(work):
    fut = concurrent.futures.Future()
    fut.set_running_or_notify_cancel()

    def waiter():
        try:
            work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the future's owner
            fut.set_exception(e)
        else:
            fut.set_result(None)

    threading.Thread(target=waiter, name="oxcomm-future", daemon=True).start()
    return fut
