"""Comparing two GPU engine runs of the same greedy requests whose arithmetic differs by roundings (another
GEMM order, another attention algorithm): the bound from bf16 arithmetic and the walk that compares
logprobs up to the first near tie. Shared by the GPU tests of test_trace_options and test_long_prefill."""

from __future__ import annotations

import numpy as np


def bf16_logit_bound(handle, prompts: list[list[int]], logprob_runs: list) -> float:
    """2 bf16 steps at the largest logit the requests' sequences reach: the model's logits are bf16 (its
    lm_head runs in the compute dtype, then cast), so a change that moves the hidden state by a rounding
    can move a logit by one bf16 step at its magnitude, and the log-sum-exp (ruled by the top logits) by
    one more. `logprob_runs`: one run's output_logprobs per prompt (its tokens extend the prompts)."""
    seqs = [list(p) + [t.token for t in lps] for p, lps in zip(prompts, logprob_runs, strict=True)]
    width = min(map(len, seqs))
    biggest = float(np.abs(handle.forward(np.asarray([q[:width] for q in seqs])).max(-1)).max())
    return 2 * 2.0 ** (np.floor(np.log2(biggest)) - 7)  # bf16: 8 significant bits


def compare_until_near_tie(run_a: list, run_b: list, bound: float) -> int:
    """Per request, the chosen tokens' logprobs within `bound` while no near tie (top-2 margin <= bound)
    decides them; past a near tie (or where the tokens part at one) the sequences may differ. Returns
    how many tokens were compared."""
    compared = 0
    for a, b in zip(run_a, run_b, strict=True):
        for x, y in zip(a, b, strict=False):
            assert abs(x.logprob - y.logprob) <= bound, (x, y, bound)
            compared += 1
            margin = min(x.top[0][1] - x.top[1][1], y.top[0][1] - y.top[1][1])
            if x.token != y.token:
                assert margin <= bound, (x, y)  # only a near tie may go either way
                break
            if margin <= bound:
                break  # past a near tie the sequences may part
    return compared
