"""Ready tensor-parallel rules: plain `[(regex, P)]` lists for `sf.specs(params, mesh, rules=...)`.

Each rule matches a leaf's dotted path in full; the first match wins, and leaves no rule matches get
`sf.specs`' default (`P("dp")`: whole on tp, FSDP-sharded over dp like every leaf). They name the
tensor-parallel axis "tp": build the mesh as `sf.mesh(dp=..., tp=...)`, or edit the lists. How a
train step runs them: Note [tensor parallel forward] in `shardfn/_tp.py`.

Example:
    >>> mesh = sf.mesh(dp=2, tp=2)
    >>> specs = sf.specs(params, mesh, rules=sf.rules.LLAMA)
    >>> step = sf.train_step(loss_fn, sf.optim.adamw(1e-3), mesh, specs=specs)
"""

from __future__ import annotations

from ._spec import P, READY_RULES

__all__ = ["LLAMA", "LLAMA_SP", "QWEN2", "MISTRAL", "GPT2", "GPT2_SP", "GPT", "GPT_SP"]

COLUMN = P("tp", None)  # an nn.Linear weight [out, in] split on its outputs
ROW = P(None, "tp")  # ... split on its inputs: each rank computes a partial sum

# peft's LoRA wraps a linear layer: its weight moves to `<layer>.base_layer.weight`, beside
# `<layer>.lora_A.<adapter>.weight` [r, in] and `<layer>.lora_B.<adapter>.weight` [out, r]. The rules
# split the base weight as the plain layer's, and the adapter on the same side: a column-parallel
# layer's B on its outputs (A whole), a row-parallel layer's A on its inputs (B whole), so the
# adapter's output is laid out as the base layer's.
_BASE = r"(\.base_layer)?"
_LORA_A, _LORA_B = r"\.lora_A\.[^.]+\.weight", r"\.lora_B\.[^.]+\.weight"

LLAMA: list[tuple[str, P]] = [
    # Attention: q/k/v column-parallel (heads split over tp), o row-parallel.
    (r".*\.self_attn\.(q_proj|k_proj|v_proj)" + _BASE + r"\.weight", COLUMN),
    (r".*\.self_attn\.(q_proj|k_proj|v_proj)" + _BASE + r"\.bias", P("tp")),  # Qwen2's q/k/v biases
    (r".*\.self_attn\.(q_proj|k_proj|v_proj)" + _LORA_B, COLUMN),
    (r".*\.self_attn\.o_proj" + _BASE + r"\.weight", ROW),
    (r".*\.self_attn\.o_proj" + _LORA_A, ROW),
    # MLP: gate/up column-parallel, down row-parallel.
    (r".*\.mlp\.(gate_proj|up_proj)" + _BASE + r"\.weight", COLUMN),
    (r".*\.mlp\.(gate_proj|up_proj)" + _LORA_B, COLUMN),
    (r".*\.mlp\.down_proj" + _BASE + r"\.weight", ROW),
    (r".*\.mlp\.down_proj" + _LORA_A, ROW),
    # Vocabulary-parallel embedding and head (tied or not); the cross-entropy stays on the shards.
    (r".*embed_tokens\.weight", P("tp", None)),
    (r"(.*\.)?lm_head\.weight", P("tp", None)),  # `base_model.model.lm_head.weight` under peft
]
"""Hugging Face Llama (`LlamaForCausalLM`), plain or with peft's LoRA adapters: heads and key/value
heads must divide by tp."""

LLAMA_SP: list[tuple[str, P]] = [
    *LLAMA,
    # Activation specs: the residual stream split on the sequence over tp. The embedding's masked
    # partial sum and the row-parallel layers' partial sums are reduce-scattered onto the sequence;
    # the linear layers holding column-parallel leaves all-gather it back before they run.
    (r".*embed_tokens", P(None, "tp")),
    (r".*\.self_attn\.o_proj", P(None, "tp")),
    (r".*\.mlp\.down_proj", P(None, "tp")),
]
"""Hugging Face Llama (Qwen2, Mistral) with sequence parallelism over tp: `LLAMA`'s rules for the
parameters and the module rules for the activations, one list for both places,
`sf.specs(params, mesh, rules=sf.rules.LLAMA_SP)` and `train_step(..., activation_specs=
sf.rules.LLAMA_SP)` (each reads the rules of its kind: Note [activation layouts] in
`shardfn/_layouts.py`)."""

QWEN2: list[tuple[str, P]] = LLAMA
"""Hugging Face Qwen2: Llama's layout (its q/k/v biases split with their weights)."""

MISTRAL: list[tuple[str, P]] = LLAMA
"""Hugging Face Mistral: Llama's layout."""

GPT2: list[tuple[str, P]] = [
    # GPT-2's Conv1D weights are transposed, [in, out]: column-parallel splits dim 1, row-parallel dim 0.
    # `attn.c_attn` packs q|k|v along its outputs: split there, each rank would hold a slice of q, k and
    # v that the split into heads gathers again; it stays whole on tp (with `attn.c_proj`), and the MLP
    # is split.
    (r".*\.mlp\.c_fc\.weight", P(None, "tp")),
    (r".*\.mlp\.c_fc\.bias", P("tp")),
    (r".*\.mlp\.c_proj\.weight", P("tp", None)),
    (r".*wte\.weight", P("tp", None)),  # the vocabulary-parallel embedding, tied to the head
]
"""Hugging Face GPT-2 (`GPT2LMHeadModel`)."""

GPT: list[tuple[str, P]] = [
    # `attn.qkv` packs q|k|v like GPT-2's c_attn: whole on tp; the MLP is split.
    (r"blocks\.\d+\.fc\.weight", COLUMN),
    (r"blocks\.\d+\.fc\.bias", P("tp")),
    (r"blocks\.\d+\.out\.weight", ROW),
    (r"wte\.weight", P("tp", None)),
    (r"head\.weight", P("tp", None)),
]
"""`shardfn.models.GPT`."""

GPT_SP: list[tuple[str, P]] = [
    *GPT,
    # Sequence parallelism over tp: the residual stream split on the sequence. The embedding's and the
    # MLP's row-parallel partial sums are reduce-scattered onto it and `fc` (column-parallel) gathers it
    # back, as in `LLAMA_SP`; the attention, whole on tp, computes on the whole sequence: its input
    # (`ln1`'s output) is all-gathered, its output sliced back onto the sequence (in the backward:
    # the gradient all-gathered for the attention's backward, that of its input sliced).
    (r"wte", P(None, "tp")),
    (r"blocks\.\d+\.ln1", P()),
    (r"blocks\.\d+\.attn", P(None, "tp")),
    (r"blocks\.\d+\.out", P(None, "tp")),
]
"""`shardfn.models.GPT` with sequence parallelism over tp (for `sf.specs` and `activation_specs`)."""

GPT2_SP: list[tuple[str, P]] = [
    *GPT2,
    # As `GPT_SP`: GPT-2's attention (c_attn, c_proj) is whole on tp, its MLP split.
    (r".*\.wte", P(None, "tp")),
    (r".*\.h\.\d+\.ln_1", P()),
    (r".*\.h\.\d+\.attn", P(None, "tp")),
    (r".*\.h\.\d+\.mlp\.c_proj", P(None, "tp")),
]
"""Hugging Face GPT-2 with sequence parallelism over tp (for `sf.specs` and `activation_specs`)."""

READY_RULES.update(rule for rules in (LLAMA, LLAMA_SP, GPT2, GPT2_SP, GPT, GPT_SP) for rule in rules)  # exempt in `sf.specs`' check of idle rules
