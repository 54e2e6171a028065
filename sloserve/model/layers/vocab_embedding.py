"""The token embedding and the LM head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.model.layers.custom_op import CustomOp
from sloserve.model.layers.linear import ReplicatedLinear


class VocabEmbedding(CustomOp):
    """Token ids [T] -> rows of ``weight`` [vocab, hidden]. Native: in the engine's dtype.
    Kernels: float32 (the residual stream), read from the quantized weight where there is one
    (``Kernels.qembed``), else from the dense one."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        #: the QuantizedWeight of the embedding where the checkpoint is served quantized
        self.quantized = None

    def set_quantized(self, qweight, shard_id=None) -> None:
        self.quantized = qweight

    def forward_native(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def forward_kernel(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.kernels.qembed(input_ids, self.quantized)
        return self.weight.index_select(0, input_ids).float()


class LMHead(ReplicatedLinear):
    """hidden [S, hidden] -> logits [S, vocab]. Tied to the embedding
    (:meth:`tie_to`): the embedding's weight and quantized weight, the latter packed again as
    the kernels' products take it (the embedding keeps its rows for ``qembed``)."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size)

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight
