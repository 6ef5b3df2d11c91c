"""What an MLP keeps for backward per token, in f-wide tensors of the activation dtype: a dense layer's MLP,
a shared expert, and each routed expert's slot (megatron-core 0.16.1's MLP.forward, unfused: the job always
sets bias_activation_fusion=False; read from its source and measured with saved-tensor hooks in
tests/test_planner_gptoss.py, tests/test_planner_llama.py and tests/test_planner_moe.py).

  x = fc1(input) (+ fc1's bias: a new tensor, fc1's own output freed; the add saves nothing)

  not gated (GELU, squared ReLU): GELU keeps x, fc2 keeps gelu(x)                                     2
      relu(x)^2: relu keeps its output r, square keeps r (the same tensor), fc2 keeps r^2          2
  gated (SwiGLU, quick GeGLU; x = [gate; up], 2f wide; megatron-core's glu()):
      gate, up = chunk(x): views, keeping all of x alive wherever one of them is saved             2
      with a clamp C: gate' = gate.clamp(max=C), up' = up.clamp(-C, C), each clamp keeping its
          input (a view of x: nothing new) and returning a new tensor                               -
      act(gate'):  SiLU keeps its input: gate' (a new tensor with a clamp, else the view)         +1 with C
                   quick_gelu, gate' * sigmoid(1.702 gate'): the product keeps gate' (+1 with C)
                   and the sigmoid's output (which sigmoid keeps too: one tensor)                  +1 (+1 with C)
      up' + offset: a new tensor (also at offset 0), kept by the product                            1
      act(gate') kept by the product                                                                1
      the product, kept by fc2 as its input                                                         1
  so GELU / ReLU^2 2, SwiGLU 5 (6 with a clamp), quick GeGLU 6 (7 with a clamp: GPT-OSS).

A routed expert scales its product by the token's routing weight before fc2 (per_token_scale): the scaled
tensor is a new one (+1 f-wide; the weight itself is counted per slot in planner/moe.py). GPT-OSS's expert
biases add nothing kept: fc1's as above, fc2's through `output += output_bias * probs` (a product of a
parameter and the routing weight, which is already kept, added in place; transient [slots, h]).
"""
from __future__ import annotations

from zo_megatron.planner.inputs import PlanInput


def mlp_saved_widths(inp: PlanInput) -> int:
    """f-wide tensors (activation dtype) a dense MLP (or a shared expert) keeps per token: 2, 5 / 6 (SwiGLU,
    with a clamp), 6 / 7 (quick GeGLU, with a clamp). The module docstring counts them."""
    if not inp.gated_mlp():
        return 2
    clamp = 1 if inp.activation_func_clamp_value is not None else 0
    # x (2) + act's own (SiLU: none but its input; quick_gelu: the sigmoid) + up' + offset + act + product
    own = 1 if inp.quick_geglu else 0
    return 2 + clamp + own + 3


def expert_saved_widths(inp: PlanInput) -> int:
    """f_e-wide tensors a routed expert keeps per slot: its MLP's, and the product scaled by the routing weight."""
    return mlp_saved_widths(inp) + 1
