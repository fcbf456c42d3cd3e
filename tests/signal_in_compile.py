"""``python tests/signal_in_compile.py DELAY ARGS...``: `seqshard ARGS...`, with SIGTERM sent to
itself DELAY seconds after the train step's first compile began (the moment a fault campaign's
signals crashed the process: 6 of 17 sent 2.0-3.5 s after launch).

A watcher thread reads the main thread's Python stack every 2 ms and fires while it is inside
JAX's ``backend_compile_and_load`` called from the training loop, so the signal lands in the
compile however fast the machine is. At the interpreter's teardown (atexit) it prints
``interpreter teardown``: a stop before the first step must end the process without it."""

import atexit
import os
import signal
import sys
import threading
import time


def _in_train_step_compile() -> bool:
    frame = sys._current_frames().get(threading.main_thread().ident)
    names = set()
    while frame is not None:
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    return {"backend_compile_and_load", "_train_steps"} <= names


def _watch(delay: float) -> None:
    while not _in_train_step_compile():
        time.sleep(0.002)
    time.sleep(delay)
    where = "in the compile" if _in_train_step_compile() else "after the compile"
    print(f"signal-in-compile: sending SIGTERM {where}", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    atexit.register(lambda: print("interpreter teardown", flush=True))
    threading.Thread(target=_watch, args=(float(sys.argv[1]),), daemon=True).start()
    from seqshard.cli import main

    sys.exit(main(sys.argv[2:]))
