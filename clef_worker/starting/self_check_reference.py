"""The start-up self-check's reference answer: one request alone through transformers' own layer
code, its Triton kernels called in the form serving has already compiled.

Why: the reference is the plain eager forward of one request (`Backbone.last_hidden_state`, one
row: transformers' Qwen3.5 layers, no packing, no graphs), the path the golden answers are
checked against, and independent of clef's packed layer code (offsets, layouts, buckets) that
the check is there to catch. But on the fla path that forward calls fla's kernels in their
fixed-length form (no `cu_seqlens`), and Triton compiles those as other kernels than the
varlen form packed serving uses: on the first H200 sitting a cold check spent about 43 s
compiling them, for a forward nothing serves with.

So while the reference runs (`serving_kernels`), the module-level functions transformers' Gated
DeltaNet layer calls at run time (`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`) are the
packed serving kernels themselves (`Backbone.packed_kernels`: the very `DeltaRule` and
`ShortConv` objects every packed forward and graph capture calls) over a one-sequence layout
(`cu_seqlens` = [0, T]). The layer code around them, the attention (SDPA, no JIT) and the head
stay transformers' and the plain runner's. A one-sequence varlen call has no boundary to get
wrong; what the check compares (several sequences in one row, graph buckets, padding, offsets)
still differs between the served forwards and the reference. What a shared kernel cannot catch
is that kernel being wrong for a lone sequence too; the golden tests and the GPU sitting's
parity step (`bench/gpu_parity.py`) check the kernels themselves.

Where nothing was compiled for packing (a padded worker: `packed_kernels` is None; the
per-sequence torch kernels of CPU and float32, which call the very module-level functions the
reference calls), the reference runs unchanged: it already runs the kernels serving runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

from torch import Tensor

from clef_worker.model import gated_delta, short_conv
from clef_worker.model.packed import PackedLayout
from clef_worker.model.packed_kernels import LOOPED, PackedKernels, modeling_module
from clef_worker.starting.variant_probe import reference_runner

if TYPE_CHECKING:
    from clef_worker.media.vision import PreparedMedia
    from clef_worker.model.backbone import Backbone
    from clef_worker.model.encoding import Encoding
    from clef_worker.serving.runner import ModelRunner
    from clef_worker.serving.staging import RowResult

# The kernel forms a reference can run in (`kernel_form`), for the verdict and the tests.
VARLEN = "one-sequence-varlen"
FIXED = "fixed-length"
# `packed_kernels.names` of a kernel compiled for the packed path (fla's Triton kernels).
COMPILED_NAME = "fla-varlen"
# transformers' keyword arguments for packed sequences: a call with any is not one sequence.
PACKING_KWARGS = ("cu_seqlens", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k")


def kernel_form(backbone: Backbone) -> str:
    """The form the reference's Gated DeltaNet kernels run in on this backbone: VARLEN where
    packed serving compiled its own kernels, FIXED otherwise (module docs)."""
    kernels = backbone.packed_kernels
    if kernels is None or kernels is LOOPED or kernels.names[0] != COMPILED_NAME:
        return FIXED
    return VARLEN


def _packing(kwargs: dict[str, Any]) -> bool:
    """Whether a call carries packed-sequence arguments of its own (the layer's other keyword
    arguments, which transformers passes along to every kernel, change nothing)."""
    return any(kwargs.get(name) is not None for name in PACKING_KWARGS)


def one_sequence_delta_rule(kernels: PackedKernels,
                            original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' `torch_chunk_gated_delta_rule` contract over the packed delta rule: a
    single row from a zero state, without its final state, runs as one varlen sequence; any
    other call (batched rows, initial or final states) goes to `original` unchanged."""

    def delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                   initial_state: Tensor | None = None, output_final_state: bool = False,
                   use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Tensor | None = None,
                   **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        if (query.shape[0] != 1 or initial_state is not None or output_final_state
                or not use_qk_l2norm_in_kernel or cu_seqlens is not None or _packing(kwargs)):
            return original(query, key, value, g=g, beta=beta, initial_state=initial_state,
                            output_final_state=output_final_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            cu_seqlens=cu_seqlens, **kwargs)
        layout = PackedLayout.from_lengths([int(query.shape[1])], query.device)
        output, _ = kernels.delta_rule(query, key, value, g, beta, layout)
        return output, None

    return delta_rule


def one_sequence_conv(kernels: PackedKernels, original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' `causal_conv1d_fn` contract (`[B, D, T]` in and out) over the packed short
    convolution (`[1, T, D]`): a single row runs as one varlen sequence; anything else goes to
    `original` unchanged."""

    def conv(x: Tensor, weight: Tensor, bias: Tensor | None = None,
             activation: str | None = None, **kwargs: Any) -> Tensor:
        if x.shape[0] != 1 or _packing(kwargs):
            return original(x, weight, bias, activation=activation, **kwargs)
        layout = PackedLayout.from_lengths([int(x.shape[-1])], x.device)
        return kernels.conv(x.transpose(1, 2), weight, bias, activation, layout).transpose(1, 2)

    return conv


@contextmanager
def serving_kernels(backbone: Backbone) -> Iterator[str]:
    """While inside: transformers' module-level Gated DeltaNet kernels are the packed serving
    kernels over one sequence, where packed serving compiled its own (module docs). Yields the
    form (`kernel_form`). Main thread only, as every forward of the worker."""
    form = kernel_form(backbone)
    kernels = backbone.packed_kernels
    if form == FIXED or kernels is None:
        yield form
        return
    module = modeling_module()
    with ExitStack() as restore:
        delta = getattr(module, gated_delta.KERNEL_NAME)
        setattr(module, gated_delta.KERNEL_NAME, one_sequence_delta_rule(kernels, delta))
        restore.callback(setattr, module, gated_delta.KERNEL_NAME, delta)
        if kernels.names[1] == COMPILED_NAME:
            conv = getattr(module, short_conv.FUNCTION_NAME)
            setattr(module, short_conv.FUNCTION_NAME, one_sequence_conv(kernels, conv))
            restore.callback(setattr, module, short_conv.FUNCTION_NAME, conv)
        yield form


def reference_answer(runner: ModelRunner, encoding: Encoding, slot: int | None = None,
                     media: PreparedMedia | None = None) -> tuple[RowResult, Tensor | None]:
    """One request alone through the plain eager forward (clef_worker.starting.variant_probe's
    `reference_runner`: no graphs, no packing, no prefix cache, the variant's adapters as
    segments), its kernels the serving ones (`serving_kernels`): its row and last hidden
    state."""
    with reference_runner(runner) as plain, serving_kernels(runner.backbone):
        output = plain.run([encoding], [media] if media is not None else (),
                           slots=() if slot is None else (slot,), keep_hidden=True)
    return output.rows[0], output.hidden
