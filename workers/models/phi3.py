"""Phi-3: Llama's architecture with q/k/v and gate/up already fused in the checkpoint.

`self_attn.qkv_proj.weight` ([q; k; v] rows) and `mlp.gate_up_proj.weight` ([gate; up] rows) are
exactly our fused projections, so loading renames them into the Llama layout. Phi-3's long-context
`longrope` scaling and partial rotary factors are refused by config parsing (ModelConfigError).
"""

from __future__ import annotations

import torch

from workers.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        c = self.config
        renamed: dict[str, torch.Tensor] = {}
        for name, tensor in weights.items():
            if name.endswith("self_attn.qkv_proj.weight"):
                prefix = name.removesuffix("qkv_proj.weight")
                q, k, v = tensor.split((c.q_size, c.kv_size, c.kv_size))
                renamed.update({f"{prefix}q_proj.weight": q, f"{prefix}k_proj.weight": k, f"{prefix}v_proj.weight": v})
            elif name.endswith("mlp.gate_up_proj.weight"):
                prefix = name.removesuffix("gate_up_proj.weight")
                gate, up = tensor.chunk(2)
                renamed.update({f"{prefix}gate_proj.weight": gate, f"{prefix}up_proj.weight": up})
            else:
                renamed[name] = tensor
        super().load_hf_state_dict(renamed)
