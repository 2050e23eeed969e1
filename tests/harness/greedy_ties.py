"""Compare the greedy outputs of two servers up to a numerical tie.

The tiny test models run in bfloat16. Two servers that compute the same prefix
on different layouts (a rank-sharded host tier against a replicated one, DP
attention against plain TP) may hold KV that differs in its last bits; that is
enough to flip a greedy token where the two best logits are a few bfloat16
steps apart, and from there on the continuations differ legitimately.

``TOP2`` asks ``/generate`` for each output token's two best logprobs;
``top2_of(meta_info)`` reads them. ``first_divergence(a, b)`` compares two
records (``output_ids`` and ``top2``) and returns ``None`` when the outputs are
equal, ``("tie", i)`` when they first differ at position ``i`` and each
server's runner-up there is the other's token within ``TIE_LOGPROB``, and
``("differ", i)`` otherwise: wrong KV moves the distribution, so a difference
that is not a tie on both servers is a failure, and so are more than
``MAX_TIES`` ties in one comparison. Where a server's two best are
exactly equal, its top-k lists them in either order while its greedy token is
the argmax's pick, so its runner-up is the entry that is not its own token.
"""

from __future__ import annotations

TOP2 = {"return_logprob": True, "top_logprobs_num": 2}

# The tiny models' logits are near 1 (their logprobs near -7 over a
# 2048-token vocabulary): the ties seen in CI were one bfloat16 step apart
# (0.0039 at -6.96, a logit in [0.5, 1)). Four such steps, two of a logit in
# [1, 2); a margin past it moved the distribution.
TIE_LOGPROB = 1 / 64
# A tie is rare; more than this many in one comparison is not rounding but a
# difference the tie rule would hide.
MAX_TIES = 2


def top2_of(meta: dict) -> list:
    """Per output token, its two best ``(logprob, token_id)`` pairs."""
    return [
        [(float(lp), int(tok)) for lp, tok, *_ in row[:2]]
        for row in meta["output_top_logprobs"]
    ]


def _runner_up_within(top2: list, own: int, other: int, tie: float) -> bool:
    """``other`` is this server's runner-up to its own greedy token ``own``
    within ``tie``: both are among its two best, ``own`` at the best logprob.
    On an exact tie the two are listed in either order (the top-k's order of
    equal values is not the sampler's argmax), so the runner-up is the entry
    that is not ``own``, wherever it is listed."""
    best = top2[0][0]
    lps = {tok: lp for lp, tok in top2}
    return own in lps and other in lps and lps[own] == best and best - lps[other] <= tie


def first_divergence(a: dict, b: dict, tie: float = TIE_LOGPROB):
    for i, (x, y) in enumerate(zip(a["output_ids"], b["output_ids"])):
        if x == y:
            continue
        if _runner_up_within(a["top2"][i], x, y, tie) and _runner_up_within(
            b["top2"][i], y, x, tie
        ):
            return ("tie", i)
        return ("differ", i)
    if len(a["output_ids"]) != len(b["output_ids"]):
        return ("differ", min(len(a["output_ids"]), len(b["output_ids"])))
    return None


def without_top2(record: dict) -> dict:
    """The record with its outputs left to ``first_divergence``."""
    return {k: v for k, v in record.items() if k not in ("output_ids", "top2")}


def assert_same_greedy(
    test, ours: list, theirs: list, what: str = "", max_ties: int = MAX_TIES
) -> list:
    """Fail ``test`` unless each pair of records agrees up to a tie and at
    most ``max_ties`` pairs part at one; return the ties found as ``(request
    index, position)`` (to print)."""
    test.assertEqual(len(ours), len(theirs), what)
    ties = []
    for n, (a, b) in enumerate(zip(ours, theirs)):
        d = first_divergence(a, b)
        if d is None:
            continue
        test.assertEqual(
            d[0],
            "tie",
            f"{what} request {n}: outputs differ at token {d[1]} without a tie: "
            f"{a['output_ids']} ({a['top2'][d[1]] if d[1] < len(a['top2']) else '-'})"
            f" vs {b['output_ids']} "
            f"({b['top2'][d[1]] if d[1] < len(b['top2']) else '-'})",
        )
        ties.append((n, d[1]))
    test.assertLessEqual(
        len(ties),
        max_ties,
        f"{what}: {len(ties)} outputs part at a tie (request, token) {ties}, "
        f"more than {max_ties}: not a rounding tie",
    )
    return ties
