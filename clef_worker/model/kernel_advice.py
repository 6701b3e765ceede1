"""transformers' advice to install fla and causal_conv1d, kept out of the log where it cannot apply.

On CPU the Gated DeltaNet layers always run a PyTorch implementation
(clef_worker.model.gated_delta's
in the native executor, transformers' reference in the release one): fla and causal_conv1d are
CUDA kernels, and the worker blocks them there (see clef_worker.model.backbone).
transformers does not know that and, on the first forward, advises installing both "for the
optimized kernel", which sends operators after packages that would change nothing. So on CPU the
advice is dropped and the worker's own line says once which path runs and why. On CUDA the advice
can be right (the packages would be used) and is left alone.
"""

from __future__ import annotations

import logging

import torch

ADVICE_LOGGER = "transformers.integrations.hub_kernels"
ADVICE_TEXT = "is falling back to its reference PyTorch implementation"
CPU_REASON = ("fla and causal_conv1d are CUDA kernels, so on CPU a PyTorch implementation is the "
              "path (transformers' advice to install them is not logged)")


class DropKernelAdvice(logging.Filter):
    """Drops transformers' fallback advice; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return ADVICE_TEXT not in record.getMessage()


def quiet_on_cpu(device: torch.device) -> str | None:
    """On CPU, silence the advice (once per process) and return why; None elsewhere."""
    if device.type != "cpu":
        return None
    logger = logging.getLogger(ADVICE_LOGGER)
    if not any(isinstance(f, DropKernelAdvice) for f in logger.filters):
        logger.addFilter(DropKernelAdvice())
    return CPU_REASON
