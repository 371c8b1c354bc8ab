"""What every benchmark script does with its report: print it, and write it to --out when given; and the timed
greedy decode loop of the CPU decode benchmarks (profile_decode.py, bench_weight_bound.py)."""

from __future__ import annotations


def emit(text: str, out: str | None, append: bool = False) -> int:
    print(text)
    if out:
        with open(out, "a" if append else "w") as f:
            f.write(text + "\n")
    return 0


def greedy_steps(runner, prompt_ids, steps: int, probe) -> list:
    """Prefill `prompt_ids` (one row) after runner.start(1, 2048), then `steps` greedy decode steps; returns
    probe() after minus probe() before each runner.step (probe: a clock, a counter)."""
    import numpy as np

    ids = np.array([prompt_ids], np.int64)
    runner.start(1, 2048)
    logits = runner.prefill(ids, np.array([ids.shape[1]], np.int64))
    out = []
    for _ in range(steps):
        nxt = np.array([int(np.argmax(logits[0]))], np.int64)
        before = probe()
        logits = runner.step(nxt)
        out.append(probe() - before)
    return out


def timed_decode(runner, prompt_ids, steps: int):
    """Greedy decode of `steps` tokens after prefilling `prompt_ids` (one row), twice: the first pass untimed.
    Returns the timed pass's (step wall seconds, ORT run seconds inside each step, tokens), the ORT time read
    by wrapping the runner's session's run_with_iobinding. The runner is left open."""
    import time

    import numpy as np

    sess, ort_s = runner.sess.session, []
    run = sess.run_with_iobinding

    def timed(io, run_options=None):
        t = time.perf_counter()
        run(io, run_options)
        ort_s.append(time.perf_counter() - t)

    sess.run_with_iobinding = timed
    ids = np.array([prompt_ids], np.int64)
    for _ in range(2):  # the first pass is untimed
        runner.start(1, 2048)
        logits = runner.prefill(ids, np.array([ids.shape[1]], np.int64))
        ort_s.clear()
        wall, toks = [], []
        for _ in range(steps):
            nxt = np.array([int(np.argmax(logits[0]))], np.int64)
            toks.append(int(nxt[0]))
            t = time.perf_counter()
            logits = runner.step(nxt)
            wall.append(time.perf_counter() - t)
    return wall, ort_s, toks
