"""The import names of the modules whose functions the worker binds or replaces.

One owner below `backbone`, `short_conv` and `packed_layers`, which all look these modules up
at call time: the text stack's modelling module (transformers' Qwen3.5) and fla's Gated
DeltaNet kernels.
"""

MODELING_MODULE = "transformers.models.qwen3_5.modeling_qwen3_5"
FLA_KERNEL_MODULE = "fla.ops.gated_delta_rule"
