"""tools/bench_train.py's correctness check: did every variant's steps do what the reference's did?

Two measures per variant, each against the median of the variants that saw the same batches:

- the change of the loss on a held-out batch (loss_before - loss_after), and
- the change of the parameters, as the L2 norm of (after - before) over the model's matrices and,
  separately, over its vectors (biases, norm weights): a variant that never updates is 100% off
  in both; one that updates half of the model moves about sqrt(1/2) of the reference's norm
  (Adam moves every parameter by about lr per step) -- 29% off -- whatever the seed, where its
  loss change can land anywhere (the half that is updated can carry nearly all of a few steps'
  loss change); one that never updates its biases and norms is 100% off in the vector norm.

The parameters are the ones the forward pass uses (bf16 weights for a bf16 module, fp32 for
autocast), so a bf16 module's change is rounded to bf16: that costs the matrices little, but the
vectors hold norm weights near 1.0, where bf16's step (2^-8 to 2^-7) is about one Adam update, so
in bf16 their norm is compared within 10% (measured: within 3.5% across the five variants).
"""
from __future__ import annotations

import statistics

FP32_RTOL, BF16_RTOL = 1e-4, 2e-2
# The loss check compares what each variant's steps did to the held-out loss, not only where it
# ended: bf16's 2e-2 on loss_after passed an engine that never updated (the steps move the loss by
# well under 2%). CHANGE_RTOL: the largest error in the loss change, relative to the reference
# change, that passes; VISIBLE: the reference change must exceed this many times the variants'
# disagreement before any step (and 1e-6 of the loss), or the check cannot tell an update from
# none and says INCONCLUSIVE (raise --lr or --steps), which fails like a mismatch.
CHANGE_RTOL = {"fp32": 0.02, "bf16": 0.2}
VISIBLE = 10.0
# The parameter check: the largest error of a group's update norm, relative to the median's, that
# passes, per precision and group. Measured (docs/performance.md), every variant of every world:
# fp32 within 6e-5 of the median (the published tables, 4 steps); bf16 within 0.3% (matrices) and
# 3.5% (vectors), and the matrices within 0.6% in tests/test_bench_loss_check.py's small model
# (weights ~0.3, bf16 steps near an Adam update). An engine updating half of the model is 28-39%
# off, one skipping the biases 100% off in the vectors.
UPDATE_RTOL = {"fp32": {"matrices": 1e-3, "vectors": 1e-3}, "bf16": {"matrices": 0.03, "vectors": 0.1}}
UPDATE_GROUPS = ("matrices", "vectors")


def update_sums(pairs) -> list[float]:
    """Sums of squares of (after - before) over (before, after, weight) triples, per group.

    `weight` is what one copy counts for (0 for a copy another rank counts, 1/replicas for a
    parameter every replica holds), so the sums all-reduced over the ranks give the model's."""
    sums = [0.0] * len(UPDATE_GROUPS)
    for before, after, weight in pairs:
        if weight:
            d = after.detach().double() - before.double().to(after.device)
            sums[0 if after.dim() > 1 else 1] += weight * float(d.square().sum())
    return sums


def _update_verdict(x: dict, refs: dict[str, float], rtol: dict[str, float]) -> str | None:
    """Set the row's update_err_<group> against the group medians `refs`; a DIFFERS line for the
    first group off by more than its tolerance, else None."""
    verdict = None
    for g, ref in refs.items():
        key = f"update_norm_{g}"
        if x.get(key) is None or ref <= 0:
            continue
        err = x[f"update_err_{g}"] = abs(x[key] - ref) / ref
        if err > rtol[g] and verdict is None:
            verdict = f"DIFFERS (parameter change of the {g}: norm {x[key]:.3e} vs {ref:.3e}: {err:.1%} off > {rtol[g]:.0%})"
    return verdict


def check_losses(members: list[dict], precision: str) -> None:
    """Set loss_check (and loss_rel_diff, loss_change, loss_change_ref, loss_change_err, loss_rtol,
    update_err_<group>) on rows that started from the same weights and saw the same batches.

    Each row's loss change (loss_before - loss_after on the held-out batch) is compared with the
    median change of the group: a row passes when its change is within CHANGE_RTOL[precision] of
    the reference change (and, in fp32, its loss_after within FP32_RTOL of the median), and each
    of its parameter-update norms (update_norm_matrices, update_norm_vectors, where the rows have
    them) within UPDATE_RTOL of the group's median. So a variant that does not update (100% off)
    or updates only part of the model fails, provided the reference change is visible: at least
    VISIBLE times the spread of loss_before (the precision schemes' own disagreement) and 1e-6 of
    the loss; otherwise every row says INCONCLUSIVE, which fails the run like a mismatch."""
    rtol = FP32_RTOL if precision == "fp32" else BF16_RTOL
    change_rtol = CHANGE_RTOL.get(precision, CHANGE_RTOL["bf16"])
    median = statistics.median
    before = median([x["loss_before"] for x in members])
    after = median([x["loss_after"] for x in members])
    ref_change = median([x["loss_before"] - x["loss_after"] for x in members])
    update_refs = {g: median([x[f"update_norm_{g}"] for x in members]) for g in UPDATE_GROUPS
                   if all(x.get(f"update_norm_{g}") is not None for x in members)}
    update_rtol = UPDATE_RTOL.get(precision, UPDATE_RTOL["bf16"])
    noise = max(max(abs(x["loss_before"] - before) for x in members), 1e-6 * abs(before))
    for x in members:
        change = x["loss_before"] - x["loss_after"]
        rel = abs(x["loss_after"] - after) / abs(after)
        x.update(loss_rel_diff=rel, loss_rtol=rtol, loss_change=change, loss_change_ref=ref_change,
                 loss_change_rtol=change_rtol)
        if abs(ref_change) < VISIBLE * noise:
            x["loss_change_err"] = None
            x["loss_check"] = (f"INCONCLUSIVE (the steps moved the loss by {ref_change:.2e}, under {VISIBLE:g}x the "
                               f"variants' disagreement before them, {noise:.1e}): raise --lr or --steps")
            continue
        err = abs(change - ref_change) / abs(ref_change)
        x["loss_change_err"] = err
        update = _update_verdict(x, update_refs, update_rtol)
        if err > change_rtol:
            x["loss_check"] = (f"DIFFERS (loss change {change:.3e} vs {ref_change:.3e}: {err:.1%} off > "
                               f"{change_rtol:.0%})")
        elif precision == "fp32" and rel > rtol:
            x["loss_check"] = f"DIFFERS ({rel:.1e} > {rtol:g})"
        elif update is not None:
            x["loss_check"] = update
        else:
            x["loss_check"] = "ok"
