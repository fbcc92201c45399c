"""Drop-in modules with Hugging Face attribute names, backed by tiletune ops."""
import torch
from torch import nn

from tiletune.ops.rms_norm import rms_norm


class RMSNorm(nn.Module):
    """Like transformers' LlamaRMSNorm: `weight` (ones at init) and `variance_epsilon`.

    The output has the input's dtype (statistics in float32)."""

    def __init__(self, hidden_size, eps=1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


LlamaRMSNorm = RMSNorm
