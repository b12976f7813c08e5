"""The decoder stack both families share: embeddings, interleaved mixer + MLP layers, final norm, LM head.

Each decoder layer holds one token mixer under the attribute name its family uses in checkpoints
(`self_attn` or `linear_attn`). Linear-attention mixers take and return recurrent state; attention mixers
read and write KV through `AttentionKV`. Parameter names equal those of the `transformers` classes.
"""

from __future__ import annotations

import torch
from torch import nn

from app.models.batch import AttentionKV, BatchLayout, LinearStates


class DecoderLayer(nn.Module):
    def __init__(self, mixer_name: str, mixer: nn.Module, mlp: nn.Module, norm_factory) -> None:
        super().__init__()
        self.mixer_name = mixer_name
        self.is_linear = getattr(mixer, "is_linear", False)
        setattr(self, mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = norm_factory()
        self.post_attention_layernorm = norm_factory()

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)


class HybridForCausalLM(nn.Module):
    """Subclasses build `self.model.layers` and set `self.config`; this class runs them.

    forward() is shaped for a serving engine (flat batch, explicit states, KV interface);
    forward_train() is the plain [B, T] path used for training and reference comparisons.
    """

    config: object
    chunk_size: int = 64
    tp_size: int = 1  # > 1 after app.models.shard.shard_model: mixer and MLP outputs are partial sums

    def _build(self, config, layers: list[DecoderLayer], final_norm: nn.Module) -> None:
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = final_norm
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def linear_layers(self) -> list[int]:
        """Indices (in the decoder stack) of the linear-attention layers, in order."""
        return [i for i, layer in enumerate(self.model.layers) if layer.is_linear]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.model.layers) if not layer.is_linear]

    def empty_states(self, batch_size: int) -> LinearStates:
        """Zero recurrent state for `batch_size` sequences (conv in the model dtype, delta-rule state fp32)."""
        weight = self.model.embed_tokens.weight
        conv, ssm = [], []
        for i in self.linear_layers:
            c_shape, s_shape = self.model.layers[i].mixer.state_shapes()
            conv.append(torch.zeros(batch_size, *c_shape, dtype=weight.dtype, device=weight.device))
            ssm.append(torch.zeros(batch_size, *s_shape, dtype=torch.float32, device=weight.device))
        return LinearStates(conv, ssm)

    def forward(
        self,
        input_ids: torch.Tensor,
        layout: BatchLayout,
        kv: AttentionKV | None = None,
        states: LinearStates | None = None,
        all_logits: bool = False,
        logit_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, LinearStates]:
        """input_ids: [N] flat tokens of `layout`. Returns logits ([N, V] if all_logits, [len(logit_rows), V] at
        those flat rows if given, else [num_seqs, V] at each sequence's last token) and the new recurrent states
        of the batch's sequences (with `.snapshots` filled when the layout asks for states inside the step, and
        `.verify` with the rollback records of its verify pieces)."""
        layout = layout.on(input_ids.device)
        hidden = self.model.embed_tokens(input_ids)
        new_conv, new_ssm, snapped = [], [], []
        j = 0
        for idx, layer in enumerate(self.model.layers):
            x = layer.input_layernorm(hidden)
            if layer.is_linear:
                conv = None if states is None else states.conv[j]
                ssm = None if states is None else states.ssm[j]
                x, conv, ssm, snaps = layer.mixer(x, layout, conv, ssm, self.chunk_size)
                new_conv.append(conv)
                new_ssm.append(ssm)
                snapped.append(snaps)
                j += 1
            else:
                x = layer.mixer(x, layout, kv, idx)
            hidden = hidden + self._reduce(x)
            hidden = hidden + self._reduce(layer.mlp(layer.post_attention_layernorm(hidden)))
        if logit_rows is not None:
            hidden = hidden[logit_rows]
        elif not all_logits and not layout.all_decode:
            hidden = hidden[layout.last_token_index]
        logits = self.lm_head(self.model.norm(hidden))
        states = LinearStates(new_conv, new_ssm)
        if any(layout.snapshots):
            states.snapshots = {key: LinearStates([s[key][0][None] for s in snapped],
                                                  [s[key][1][None] for s in snapped])
                                for key in snapped[0] if key[0] != "verify"}
        if layout.verify:
            states.verify = {i: [s[("verify", i)] for s in snapped] for i in layout.verify}
        return logits, states

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            torch.distributed.all_reduce(x)
        return x

    def forward_train(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, T] -> logits [B, T, V], from zero state with nothing cached."""
        b, t = input_ids.shape
        logits, _ = self.forward(input_ids.reshape(-1), BatchLayout.uniform(b, t), all_logits=True)
        return logits.view(b, t, -1)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
