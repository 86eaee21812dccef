"""Which ops' outputs are plain sums of one input's elements (torch-free data, shared by the
dumper, which measures how much such a sum cancels, and compare's verdict, which allows for it).

A bias or normalisation-parameter gradient is the sum of the incoming gradient over the batch
(and positions); a reduction is a sum. When the terms cancel (the bias gradient of a
convolution followed by BatchNorm is 0 in exact arithmetic; a LayerNorm's grad_bias with
sum|dY| / |sum dY| ~ 500), every rounding of a partial sum is an error relative to the small
result that many times larger than the unit roundoff: kappa = ||sum of |terms| || / ||sum||.
The dumper records kappa with an op's own error (npu_dumper/replay/own_error.py), and the
verdict widens the bound of these outputs by it (accucmp/compare/op_policies.py, CANCELLING_SUMS).
"""

from __future__ import annotations

# aten overload packet -> outputs (the dump's names) that are sums of one input's elements
SUM_OUTPUTS: dict[str, tuple[str, ...]] = {
    "aten.convolution_backward": ("result2",),            # grad_bias = sum of grad_output
    "aten.native_layer_norm_backward": ("result2",),      # grad_bias
    # grad_bias; and grad_input in training, (g - mean(g) - xhat * mean(g * xhat)) * invstd * w:
    # over few values a channel it cancels (2 values: 0 in exact arithmetic when var >> eps);
    # its kappa is that combination's |terms| (npu_dumper/replay/own_error.py, _COMBINED_TERMS)
    "aten.native_batch_norm_backward": ("result0", "result2"),
    "aten.native_group_norm_backward": ("result2",),      # grad_bias
    # the saved mean, a sum of the input's elements over the normalised dims (divided by
    # their number): near 0 when the input is centred (a residual sum), where compiled and
    # eager code hold rounding noise from different reduction orders (BERT, docs/COMPILED.md)
    "aten.native_layer_norm": ("result1",),
    "aten.sum": ("result",),
    "aten.mean": ("result",),
    "aten.nansum": ("result",),
}


# A sum output and the input whose elements it adds, for recomputing how much the sum cancels
# from the golden's recorded input (accucmp/compare/cancellation.py: a load-replay made
# without own error rounded that input): (output, input argument, the axes the sum keeps):
# "channel" keeps dim 1 (grad_bias of convolution, batch and group norm: a sum over the batch
# and the spatial dims), "trailing" keeps the output's own dims at the end (layer norm's
# grad_bias, over normalized_shape), "dim" reduces the op's `dim` argument (all dims when
# absent or empty).
SUM_TERMS: dict[str, tuple[str, str, str]] = {
    "aten.convolution_backward": ("result2", "grad_output", "channel"),
    "aten.native_batch_norm_backward": ("result2", "grad_out", "channel"),
    "aten.native_group_norm_backward": ("result2", "grad_out", "channel"),
    "aten.native_layer_norm_backward": ("result2", "grad_out", "trailing"),
    "aten.sum": ("result", "self", "dim"),
    "aten.mean": ("result", "self", "dim"),
}


def sum_terms(op: str, output: str) -> tuple[str, str] | None:
    """(input argument, kept-axes rule) of `op`'s output `output` when it is a sum of that
    input's elements (SUM_TERMS), else None."""
    entry = SUM_TERMS.get(".".join(str(op).split(".")[:2]))
    return (entry[1], entry[2]) if entry is not None and entry[0] == output else None


def sum_outputs(op: str) -> tuple[str, ...]:
    """The outputs of `op` ("aten.sum.dim_IntList" or its packet) that are sums of terms."""
    parts = str(op).split(".")
    return SUM_OUTPUTS.get(".".join(parts[:2]), ())


# dtype casts: autocast and a model cast add them by design, so one of two independent runs may
# have them and the other not (compare: not a structural difference); the dumper treats a cast
# of a leaf (a parameter, a buffer, the batch) as that leaf (a weight converted wrongly is
# judged where the cast copy is read)
CASTS: frozenset[str] = frozenset((
    "aten._to_copy", "aten.to", "aten._autocast_to_reduced_precision", "aten._autocast_to_full_precision"))


def is_cast(op: str) -> bool:
    return ".".join(str(op).split(".")[:2]) in CASTS
