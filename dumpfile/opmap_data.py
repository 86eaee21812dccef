"""The op-name map as plain data (torch-free): ops that compute the same thing under
different names on different devices, and argument names that differ between them.

Load-replay (npu_dumper.replay) uses it to match a live op to a recorded op of another
name; accucmp can use it to pair rows of two dumps from different devices. Names are
overload packets ("aten.native_batch_norm"); full overload names
("aten.native_batch_norm.default") are reduced to their packet by `packet_of`.

`npu_dumper.opmap.get_op_map()` returns these groups, plus what the user registered.
"""

from __future__ import annotations

# Each tuple: names that are interchangeable for matching. Order does not matter.
EQUIVALENT_OPS: tuple[tuple[str, ...], ...] = (
    # batch-norm forward: native (CPU), cudnn / miopen (CUDA / ROCm), functional variants, NPU
    ("aten.native_batch_norm", "aten.cudnn_batch_norm", "aten.miopen_batch_norm",
     "aten._native_batch_norm_legit", "aten._native_batch_norm_legit_no_training",
     "aten._batch_norm_with_update", "aten._batch_norm_no_update",
     "npu.native_batch_norm", "npu.npu_batch_norm"),
    # batch-norm backward
    ("aten.native_batch_norm_backward", "aten.cudnn_batch_norm_backward",
     "aten.miopen_batch_norm_backward", "aten.batch_norm_backward",
     "npu.native_batch_norm_backward", "npu.npu_batch_norm_backward"),
    # convolution forward
    ("aten.convolution", "aten._convolution", "aten.cudnn_convolution",
     "aten.miopen_convolution", "aten.mkldnn_convolution", "aten.thnn_conv2d",
     "aten._slow_conv2d_forward", "aten.slow_conv3d_forward",
     "npu.npu_convolution", "npu.npu_conv2d"),
    ("aten.cudnn_convolution_transpose", "aten.miopen_convolution_transpose",
     "npu.npu_convolution_transpose", "npu.npu_conv_transpose2d"),
    # convolution backward
    ("aten.convolution_backward", "aten.cudnn_convolution_backward",
     "aten.miopen_convolution_backward", "aten.mkldnn_convolution_backward",
     "aten._slow_conv2d_backward", "npu.npu_convolution_backward",
     "npu.npu_conv2d_backward"),
    # layer norm: native vs NPU
    ("aten.native_layer_norm", "npu.npu_layer_norm"),
    ("aten.native_layer_norm_backward", "npu.npu_layer_norm_backward"),
    # dropout: native vs NPU (replay matches shapes; values come from the recording)
    ("aten.native_dropout", "npu.npu_dropout", "npu._npu_dropout"),
    ("aten.native_dropout_backward", "npu.npu_dropout_backward"),
    # fused attention variants
    ("aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
     "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu"),
)

# Argument renames between equivalent ops, each pair read both ways.
PARAM_RENAMES: tuple[tuple[str, str], ...] = (
    ("self", "input"),
    ("eps", "epsilon"),
    ("momentum", "exponential_average_factor"),
    ("grad_out", "grad_output"),
    ("save_invstd", "save_var"),       # cudnn's "save_var" holds the inverse std, as native's
    ("training", "train"),
)


def packet_of(name: str) -> str:
    """'aten.addmm.default' -> 'aten.addmm'; a name with fewer than three parts is kept."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) >= 3 else name


def build_equivalence(groups=EQUIVALENT_OPS, extra: dict[str, list[str] | tuple[str, ...]] | None = None
                      ) -> dict[str, tuple[str, ...]]:
    """name -> every other name it may match (symmetric, transitive within a group)."""
    union: dict[str, set[str]] = {}

    def join(names):
        merged = set(names)
        for n in names:
            merged |= union.get(n, set())
        for n in merged:
            union[n] = merged

    for g in groups:
        join(g)
    for k, vs in (extra or {}).items():
        join([k, *([vs] if isinstance(vs, str) else vs)])
    return {n: tuple(sorted(s - {n})) for n, s in union.items()}


def build_renames(pairs=PARAM_RENAMES, extra: dict[str, str] | None = None) -> dict[str, tuple[str, ...]]:
    """argument name -> names it may be stored under in an equivalent op."""
    out: dict[str, set[str]] = {}
    for a, b in [*pairs, *((extra or {}).items())]:
        out.setdefault(a, set()).add(b)
        out.setdefault(b, set()).add(a)
    return {k: tuple(sorted(v)) for k, v in out.items()}
