"""Agreement with llama.cpp's greedy continuations (tests/data/smollm2_llamacpp_reference.json).

llama.cpp multiplies with the quantized weights while ortkv runs the dequantized float32 ones, so free
running continuations drift apart after a near tie. The fair figure is teacher-forced top-1 agreement:
feed the prompt and llama.cpp's continuation in one prefill and count the positions where our argmax
is llama.cpp's next token."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def load_reference(path) -> dict:
    return json.loads(Path(path).read_text())


def top1_agreement(runner, cases: list[dict], max_length: int = 2048) -> list[dict]:
    """Per case: the positions compared and how many of them match (ortkv runner)."""
    out = []
    for case in cases:
        seq = list(case["prompt_ids"]) + list(case["new_ids"])
        ids = np.array([seq], np.int64)
        runner.start(1, max_length)
        logits = runner.logits_all(ids)[0]
        n_prompt = len(case["prompt_ids"])
        pred = logits[n_prompt - 1:len(seq) - 1].argmax(-1)
        truth = np.array(case["new_ids"])
        out.append({"prompt": case["prompt"], "kind": case["kind"], "positions": len(truth),
                    "top1_matches": int((pred == truth).sum())})
    return out
