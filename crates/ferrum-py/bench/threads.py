"""Two Python threads running sessions at once against one after the other: with the GIL released
while a model runs (kernels on one thread each), the pair in parallel takes well under the serial
time on a machine with two free cores. A timing, so a benchmark rather than a test (the test
suite checks the GIL is released by a load-independent test, `test_gil_released_while_running`).

Usage: python threads.py [MODEL.onnx]   (default: the squeezenet light model of .onnx-tests)
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import threading
import time

import numpy as np

import ferrum

REPO = pathlib.Path(__file__).resolve().parents[3]


def main() -> None:
    if len(sys.argv) > 1:
        model = sys.argv[1]
    else:
        model = str(next((REPO / ".onnx-tests" / "light").glob("*squeezenet*")) / "model.onnx")
    so = ferrum.SessionOptions()
    so.intra_op_num_threads = 1
    sessions = [ferrum.InferenceSession(model, so) for _ in range(2)]
    name = sessions[0].get_inputs()[0].name
    x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    reps = 6

    def work(s):
        for _ in range(reps):
            s.run(None, {name: x})

    work(sessions[0])  # warm-up
    ratios = []
    for _ in range(5):
        t0 = time.perf_counter()
        work(sessions[0])
        work(sessions[1])
        serial = time.perf_counter() - t0
        threads = [threading.Thread(target=work, args=(s,)) for s in sessions]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ratios.append((time.perf_counter() - t0) / serial)
    print(f"parallel / serial time, 2 threads x {reps} runs: median {statistics.median(ratios):.2f} "
          f"(rounds {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
