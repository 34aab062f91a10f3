"""``Work.get_future()``: a ``concurrent.futures.Future`` completed by a waiter thread.

``wait`` is what the thread blocks on (default ``work.wait``); a staged device op passes its
``synchronize``, so that the future completes when the result is in place on the device.
"""

import concurrent.futures
import threading


def future_of(work, wait=None):
    fut = concurrent.futures.Future()
    fut.set_running_or_notify_cancel()
    block = work.wait if wait is None else wait

    def waiter():
        try:
            block()
        except BaseException as e:  # noqa: BLE001 - handed to the future's owner
            fut.set_exception(e)
        else:
            fut.set_result(None)

    threading.Thread(target=waiter, name="oxcomm-future", daemon=True).start()
    return fut
