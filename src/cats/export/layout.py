"""What each engine reads from an EAGLE-3 head, checked against their loaders' code (vLLM
``model_executor/models/llama_eagle3.py``, SGLang ``srt/models/llama_eagle3.py`` and its model runner, llama.cpp
``src/models/eagle3.cpp``, ``common/speculative.cpp`` and ``conversion/llama.py``):

- Tensors (vLLM and SGLang): ``fc.weight`` [H, 3H]; ``midlayer.{input_layernorm, hidden_norm,
  post_attention_layernorm}.weight``; ``midlayer.self_attn.{q,k,v,o}_proj.weight`` (q/k/v read 2H, no biases);
  ``midlayer.mlp.{gate,up,down}_proj.weight``; ``norm.weight``; ``lm_head.weight`` [V_d, H]; ``d2t`` (int64, target id
  minus draft id) and ``t2d`` (bool over the target vocabulary, skipped by both). No ``embed_tokens``: both take the
  target's embeddings when the head has none.
- The aux layers, where they differ: vLLM and llama.cpp capture the state *entering* layer i (the residual stream
  before it, ``hidden_states + residual``), so their id i is CATS's "after i layers". SGLang's
  ``set_eagle3_layers_to_capture`` adds one to each id (it captures the state entering layer i + 1), so its id is
  i - 1 for the same state. vLLM reads the top-level ``eagle_aux_hidden_state_layer_ids``, SGLang
  ``eagle_config.eagle_aux_hidden_state_layer_ids``; without them all three take the states entering layers 2,
  n/2 and n-3 (`cats.model.eagle3.default_aux_layers`), but a head that names its layers must name them per engine.
- SGLang ties ``lm_head`` to ``embed_tokens`` when ``tie_word_embeddings`` is true: the configs say false.
- llama.cpp (GGUF ``eagle3``): ``eagle3.target_layers`` (ids as vLLM's), ``eagle3.target_hidden_size``, tensors
  ``fc.weight``, ``blk.0.attn_norm`` (input_layernorm), ``blk.0.attn_norm_2`` (hidden_norm), ``blk.0.attn_{q,k,v,
  output}``, ``blk.0.ffn_{norm,gate,up,down}``, ``output_norm``, ``output`` and ``d2t`` as I64 *absolute* target ids.
  Its rotary is the interleaved (NORM) kind, so q and k rows are permuted as llama.cpp's converter does for Llama.
  The draft GGUF carries the target's tokenizer (llama-server checks that draft and target vocabularies match).
"""

ENGINES = ("vllm", "sglang", "llama.cpp")
ARCHITECTURES = {"vllm": "Eagle3LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle3"}


def engine_aux_ids(engine: str, aux_layers: list[int]) -> list[int]:
    """The ids ``engine`` must be given to capture the states after ``aux_layers`` layers (see the module doc)."""
    return [layer - 1 for layer in aux_layers] if engine == "sglang" else list(aux_layers)
