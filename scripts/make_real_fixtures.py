#!/usr/bin/env python
"""Make NVFP4 MoE checkpoints with the real producers, and record the producers' own forward.

Each fixture is a tiny randomly initialised Hugging Face MoE model (``DeepseekV3``, ``Glm4Moe``,
``DeepseekV4``, ``Kimi_K25``, ``MiniMaxM2``, ``Qwen2Moe``, ``Llama4`` text, ``GptOss``)
(built from a config: nothing is downloaded), quantized on the CPU by the tool itself, and
written by the tool's own exporter:

* NVIDIA ModelOpt (``nvidia-modelopt[hf]``): ``mtq.quantize`` + ``export_hf_checkpoint``;
* llmcompressor / compressed-tensors: ``oneshot`` + ``save_pretrained(save_compressed=True)``.

Beside the checkpoint the script stores ``reference.safetensors`` with, for every MoE layer,
the layer's input ``x`` (the real hidden states that reach the layer on a fixed batch of
tokens), the Hugging Face router's choice (``topk_ids``, ``topk_weights``, ``router_logits``),
the tool's fake-quantized forward of the whole MoE block ``y`` (routed experts + shared
expert, bf16 as the tool computes it) and of its shared expert alone ``y_shared``, the
same forward of a float32 copy of the calibrated model ``y_fp32`` (the tool's math without
its bf16 roundings), and activation bytes made by the tool's own NVFP4
quantize function (ModelOpt ``NVFP4QTensor.quantize``; compressed-tensors
``quantize`` + ``pack_fp4_to_uint8``) on the GEMM inputs it saw: ``act1.*`` on ``x`` with the
layer's first-GEMM input scale of one expert, ``act2.*`` on that expert's SwiGLU output.

DeepSeek-V4 fixtures (``arch="deepseek_v4"``) have a hash-routed layer (``tid2eid``) and a top-k
layer, weights scaled so that the SwiGLU clamp bites, and record per layer the token ids
(``input_ids``) and the float32 model's router choice (``*_fp32``). llmcompressor's DeepSeek-V4
checkpoints are saved with the mapping its ``load_quantizable_moe`` registers (DeepSeek's
upstream names); its DeepSeek-V4 venv needs transformers 5.17.

Kimi-K2.5 (``kimi_k25``: DeepSeek-V3 in the multimodal wrapper), MiniMax-M2, Qwen2-MoE (a
sigmoid-gated singular ``shared_expert``), Llama 4 (``llama4_text``: the router weight on the
expert's input) and gpt-oss (``gpt_oss``: expert and router biases, interleaved gate/up, the
clamped activation) fixtures are built the same way; their reference holds no activation bytes.

The two producers pin different ``transformers`` versions, so each runs in its own venv:

    /path/venv-modelopt/bin/python scripts/make_real_fixtures.py modelopt --out tests/fixtures/real
    /path/venv-llmc/bin/python     scripts/make_real_fixtures.py llmcompressor --out tests/fixtures/real

(or ``all``, which runs whichever producers the current interpreter can import). The result
is deterministic for a given producer version (fixed seeds). ModelOpt's fake-quant forward
needs CUDA for its dynamic block quantizer; on a CPU the script swaps in a quantizer built on
ModelOpt's own pure-torch ``NVFP4QTensor.quantize`` / ``dequantize`` with the calibrated amax
(the same functions its exporter uses), so the recorded forward is still ModelOpt's math.
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
from pathlib import Path

import torch

# One spec per fixture: model shape, routing, producer, scheme. Small on purpose (a few
# hundred KB each): they are committed to the repository.
FIXTURES = {
    # ModelOpt NVFP4 (W4A4), shared expert quantized too (the tool's default)
    "modelopt_nvfp4": dict(producer="modelopt", scheme="NVFP4", shared="nvfp4", seed=11,
                           experts=8, top_k=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                           norm_topk_prob=True),
    # ModelOpt NVFP4 (W4A4) with the shared expert kept in bf16 by a quantizer rule
    "modelopt_nvfp4_shared_bf16": dict(producer="modelopt", scheme="NVFP4", shared="bf16", seed=12,
                                       experts=6, top_k=2, n_group=2, topk_group=1,
                                       routed_scaling_factor=1.5, norm_topk_prob=False),
    # compressed-tensors nvfp4-pack-quantized, W4A4, shared expert quantized
    "llmc_nvfp4": dict(producer="llmcompressor", scheme="NVFP4", shared="nvfp4", seed=21,
                       experts=8, top_k=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                       norm_topk_prob=True),
    # compressed-tensors nvfp4-pack-quantized, W4A16 (weights only), shared expert in bf16
    "llmc_nvfp4a16": dict(producer="llmcompressor", scheme="NVFP4A16", shared="bf16", seed=22,
                          experts=6, top_k=3, n_group=2, topk_group=2, routed_scaling_factor=1.0,
                          norm_topk_prob=True),
    # DeepSeek-V4 (transformers deepseek_v4): layer 0 hash-routed (tid2eid), layer 1 top-k of
    # sqrt(softplus) scores + correction bias; SwiGLU clamped at swiglu_limit on routed and
    # shared experts, weights scaled so that the clamp bites.
    # GLM-4.5 MoE (transformers glm4_moe): DeepSeek-V3's router; llmcompressor's save needs
    # num_mtp_layers=0
    "modelopt_glm4_nvfp4": dict(arch="glm4_moe", producer="modelopt", scheme="NVFP4", shared="nvfp4", seed=51,
                                experts=8, top_k=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                norm_topk_prob=True),
    "llmc_glm4_nvfp4": dict(arch="glm4_moe", producer="llmcompressor", scheme="NVFP4", shared="nvfp4", seed=52,
                            experts=8, top_k=3, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                            norm_topk_prob=True),
    "modelopt_v4_nvfp4": dict(arch="deepseek_v4", producer="modelopt", scheme="NVFP4", shared="nvfp4", seed=31,
                              experts=8, top_k=2, routed_scaling_factor=1.5, swiglu_limit=10.0),
    "llmc_v4_nvfp4": dict(arch="deepseek_v4", producer="llmcompressor", scheme="NVFP4", shared="nvfp4", seed=41,
                          experts=8, top_k=3, routed_scaling_factor=1.5, swiglu_limit=10.0),
    "llmc_v4_nvfp4a16": dict(arch="deepseek_v4", producer="llmcompressor", scheme="NVFP4A16", shared="bf16",
                             seed=42, experts=6, top_k=2, routed_scaling_factor=2.0, swiglu_limit=7.0),
    # Kimi-K2.5 (transformers kimi_k25): a DeepSeek-V3 text model inside a multimodal wrapper
    # (routing in text_config; the vision tower left unquantized). ModelOpt writes
    # model.language_model.layers.N, llmcompressor language_model.model.blocks.N.
    "modelopt_kimi_k25_nvfp4": dict(arch="kimi_k25", producer="modelopt", scheme="NVFP4", shared="nvfp4", seed=61,
                                    experts=8, top_k=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                    norm_topk_prob=True),
    "llmc_kimi_k25_nvfp4": dict(arch="kimi_k25", producer="llmcompressor", scheme="NVFP4", shared="nvfp4", seed=62,
                                experts=8, top_k=3, n_group=1, topk_group=1, routed_scaling_factor=1.5,
                                norm_topk_prob=True),
    "llmc_kimi_k25_nvfp4a16": dict(arch="kimi_k25", producer="llmcompressor", scheme="NVFP4A16", shared="bf16",
                                   seed=63, experts=6, top_k=2, n_group=2, topk_group=1,
                                   routed_scaling_factor=2.0, norm_topk_prob=False),
    # MiniMax-M2 (transformers minimax_m2): sigmoid top-k with the block-level
    # e_score_correction_bias, always normalised, no shared expert
    "modelopt_minimax_m2_nvfp4": dict(arch="minimax_m2", producer="modelopt", scheme="NVFP4", shared="none",
                                      seed=71, experts=8, top_k=2),
    "llmc_minimax_m2_nvfp4": dict(arch="minimax_m2", producer="llmcompressor", scheme="NVFP4", shared="none",
                                  seed=72, experts=8, top_k=3),
    "llmc_minimax_m2_nvfp4a16": dict(arch="minimax_m2", producer="llmcompressor", scheme="NVFP4A16", shared="none",
                                     seed=73, experts=6, top_k=2),
    # Qwen2-MoE (transformers qwen2_moe): softmax top-k, a singular shared_expert (its own width)
    # scaled per token by sigmoid(shared_expert_gate(x)); the gate stays unquantized
    "modelopt_qwen2_moe_nvfp4": dict(arch="qwen2_moe", producer="modelopt", scheme="NVFP4", shared="nvfp4",
                                     seed=81, experts=8, top_k=2, norm_topk_prob=False),
    "llmc_qwen2_moe_nvfp4": dict(arch="qwen2_moe", producer="llmcompressor", scheme="NVFP4", shared="nvfp4",
                                 seed=82, experts=8, top_k=3, norm_topk_prob=True),
    "llmc_qwen2_moe_nvfp4a16": dict(arch="qwen2_moe", producer="llmcompressor", scheme="NVFP4A16", shared="bf16",
                                    seed=83, experts=6, top_k=2, norm_topk_prob=False),
    # Llama 4 (transformers llama4_text): top-1 sigmoid, the router weight applied to the
    # expert's input, a shared expert; ModelOpt keeps the experts fused and transposed
    "modelopt_llama4_nvfp4": dict(arch="llama4_text", producer="modelopt", scheme="NVFP4", shared="nvfp4",
                                  seed=91, experts=8, top_k=1),
    "llmc_llama4_nvfp4": dict(arch="llama4_text", producer="llmcompressor", scheme="NVFP4", shared="nvfp4",
                              seed=92, experts=8, top_k=1),
    "llmc_llama4_nvfp4a16": dict(arch="llama4_text", producer="llmcompressor", scheme="NVFP4A16", shared="bf16",
                                 seed=93, experts=6, top_k=1),
    # gpt-oss (transformers gpt_oss): router with a bias, softmax over the top-k logits; experts
    # with biases on both GEMMs, gate/up interleaved, the clamped activation (limit 7, alpha
    # 1.702, up + 1). ModelOpt keeps the experts fused and transposed, llmcompressor splits them
    # per expert (with .bias tensors)
    "modelopt_gpt_oss_nvfp4": dict(arch="gpt_oss", producer="modelopt", scheme="NVFP4", shared="none",
                                   seed=101, experts=8, top_k=2),
    "llmc_gpt_oss_nvfp4": dict(arch="gpt_oss", producer="llmcompressor", scheme="NVFP4", shared="none",
                               seed=102, experts=8, top_k=3),
    "llmc_gpt_oss_nvfp4a16": dict(arch="gpt_oss", producer="llmcompressor", scheme="NVFP4A16", shared="none",
                                  seed=103, experts=6, top_k=2),
}

#: families whose fixtures record no activation bytes (the tests compare forwards and routing)
NO_ACT_BYTES = ("kimi_k25", "minimax_m2", "qwen2_moe", "llama4_text", "gpt_oss")

HIDDEN = 128
MOE_INTER = 64
LAYERS = 2          # both MoE (first_k_dense_replace=0)
VOCAB = 256
CALIB_SEQS, CALIB_LEN = 16, 32
TEST_SEQS, TEST_LEN = 2, 24   # 48 tokens per MoE layer in the reference


def build_model(spec: dict):
    arch = spec.get("arch")
    if arch == "deepseek_v4":
        return build_model_v4(spec)
    if arch == "kimi_k25":
        return build_model_kimi_k25(spec)
    if arch == "minimax_m2":
        return build_model_minimax_m2(spec)
    if arch == "qwen2_moe":
        return build_model_qwen2_moe(spec)
    if arch == "llama4_text":
        return build_model_llama4(spec)
    if arch == "gpt_oss":
        return build_model_gpt_oss(spec)
    return build_model_v3(spec)  # deepseek_v3 or glm4_moe


def moe_blocks(model) -> list:
    """The MoE block of each decoder layer (every layer of these fixtures is MoE)."""
    inner = model.model
    if hasattr(inner, "language_model"):  # kimi_k25: the text model inside the wrapper
        inner = inner.language_model
    return [layer.feed_forward if hasattr(layer, "feed_forward") else layer.mlp for layer in inner.layers]


def _spread_experts(gu, dp, g, e, inter, transposed=False):
    """Random fused experts with up 0.1x-10x the gate per expert (``gu`` [E, 2I, H], or
    [E, H, 2I] when ``transposed``; gate first)."""
    gu.copy_(torch.randn(gu.shape, generator=g) * HIDDEN ** -0.5)
    ratio = (10 ** (2 * torch.rand(e, generator=g) - 1)).view(e, 1, 1)
    if transposed:
        gu[:, :, inter:] *= ratio
    else:
        gu[:, inter:, :] *= ratio
    dp.copy_(torch.randn(dp.shape, generator=g) * inter ** -0.5)


def _spread_mlp(mlp, g, scale=1.0):
    for lin in (mlp.gate_proj, mlp.up_proj):
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * scale * HIDDEN ** -0.5)
    mlp.down_proj.weight.copy_(torch.randn(mlp.down_proj.weight.shape, generator=g) * mlp.down_proj.weight.shape[1] ** -0.5)


def build_model_kimi_k25(spec: dict):
    """A tiny random Kimi-K2.5: a DeepSeek-V3 text model (as :func:`build_model_v3`) inside the
    multimodal wrapper, with a one-layer vision tower (left unquantized)."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    torch.manual_seed(spec["seed"])
    text = dict(model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                moe_intermediate_size=MOE_INTER, num_hidden_layers=LAYERS, first_k_dense_replace=0,
                num_attention_heads=2, num_key_value_heads=2, n_routed_experts=spec["experts"],
                num_experts_per_tok=spec["top_k"], n_shared_experts=1, n_group=spec["n_group"],
                topk_group=spec["topk_group"], norm_topk_prob=spec["norm_topk_prob"],
                routed_scaling_factor=spec["routed_scaling_factor"], max_position_embeddings=128,
                q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                num_nextn_predict_layers=0, tie_word_embeddings=False)
    vision = dict(patch_size=4, num_attention_heads=2, num_hidden_layers=1, hidden_size=16, intermediate_size=16,
                  pos_emb_height=4, pos_emb_width=4, pos_emb_time=1)
    cfg = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=16, tie_word_embeddings=False)
    cfg.architectures = ["Kimi_K25ForConditionalGeneration"]
    model = Kimi_K25ForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(spec["seed"] + 1000)
    e = spec["experts"]
    with torch.no_grad():
        for mlp in moe_blocks(model):
            mlp.gate.weight.copy_(torch.randn(mlp.gate.weight.shape, generator=g) * 0.08)
            mlp.gate.e_score_correction_bias.copy_(torch.randn(e, generator=g) * 0.05)
            _spread_experts(mlp.experts.gate_up_proj, mlp.experts.down_proj, g, e, MOE_INTER)
            _spread_mlp(mlp.shared_experts, g)
    return model.eval(), cfg


def build_model_minimax_m2(spec: dict):
    """A tiny random MiniMax-M2 with a spread block-level ``e_score_correction_bias`` (the
    sigmoid scores are all near 0.5, so the bias decides many choices)."""
    from transformers import AutoModelForCausalLM, MiniMaxM2Config

    torch.manual_seed(spec["seed"])
    cfg = MiniMaxM2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MOE_INTER, num_hidden_layers=LAYERS,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=spec["experts"],
                          num_experts_per_tok=spec["top_k"], max_position_embeddings=128, tie_word_embeddings=False)
    cfg.architectures = ["MiniMaxM2ForCausalLM"]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(spec["seed"] + 1000)
    e = spec["experts"]
    with torch.no_grad():
        for mlp in moe_blocks(model):
            mlp.gate.weight.copy_(torch.randn(mlp.gate.weight.shape, generator=g) * 0.08)
            mlp.e_score_correction_bias.copy_(torch.randn(e, generator=g) * 0.05)
            _spread_experts(mlp.experts.gate_up_proj, mlp.experts.down_proj, g, e, MOE_INTER)
    return model.eval(), cfg


QWEN2_SHARED_INTER = 96


def build_model_qwen2_moe(spec: dict):
    """A tiny random Qwen2-MoE: the shared expert of its own width, its sigmoid gate spread so
    that the per-token scale varies (0.1-0.9)."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    torch.manual_seed(spec["seed"])
    cfg = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         moe_intermediate_size=MOE_INTER, shared_expert_intermediate_size=QWEN2_SHARED_INTER,
                         num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=2,
                         num_experts=spec["experts"], num_experts_per_tok=spec["top_k"],
                         norm_topk_prob=spec["norm_topk_prob"], max_position_embeddings=128, tie_word_embeddings=False)
    cfg.architectures = ["Qwen2MoeForCausalLM"]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(spec["seed"] + 1000)
    e = spec["experts"]
    with torch.no_grad():
        for mlp in moe_blocks(model):
            mlp.gate.weight.copy_(torch.randn(mlp.gate.weight.shape, generator=g) * 0.08)
            _spread_experts(mlp.experts.gate_up_proj, mlp.experts.down_proj, g, e, MOE_INTER)
            _spread_mlp(mlp.shared_expert, g)
            mlp.shared_expert_gate.weight.copy_(torch.randn(mlp.shared_expert_gate.weight.shape, generator=g) * 0.15)
    return model.eval(), cfg


def build_model_llama4(spec: dict):
    """A tiny random Llama 4 text model, every layer MoE: experts fused and transposed
    (``gate_up_proj`` [E, H, 2I]), a router strong enough that the sigmoid weights spread."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(spec["seed"])
    cfg = Llama4TextConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MOE_INTER,
                           intermediate_size_mlp=2 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=64, num_local_experts=spec["experts"],
                           num_experts_per_tok=spec["top_k"], interleave_moe_layer_step=1,
                           max_position_embeddings=128, tie_word_embeddings=False)
    cfg.architectures = ["Llama4ForCausalLM"]
    model = Llama4ForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(spec["seed"] + 1000)
    e = spec["experts"]
    with torch.no_grad():
        for moe in moe_blocks(model):
            moe.router.weight.copy_(torch.randn(moe.router.weight.shape, generator=g) * 0.15)
            _spread_experts(moe.experts.gate_up_proj, moe.experts.down_proj, g, e, MOE_INTER, transposed=True)
            _spread_mlp(moe.shared_expert, g)
    return model.eval(), cfg


def build_model_gpt_oss(spec: dict):
    """A tiny random gpt-oss, every layer MoE: experts fused and transposed (``gate_up_proj``
    [E, H, 2I], gate and up columns interleaved), gate and up columns scaled per expert
    (0.5x-8x) so that some pre-activations pass the clamp at 7 (gate above, up on both
    sides); every bias spread (router, gate/up, down), so that each one matters."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    torch.manual_seed(spec["seed"])
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MOE_INTER, num_hidden_layers=LAYERS,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=spec["experts"],
                       num_experts_per_tok=spec["top_k"], sliding_window=16,
                       layer_types=["sliding_attention", "full_attention"][:LAYERS], max_position_embeddings=128,
                       tie_word_embeddings=False)
    cfg.architectures = ["GptOssForCausalLM"]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(spec["seed"] + 1000)
    e = spec["experts"]
    with torch.no_grad():
        for mlp in moe_blocks(model):
            mlp.router.weight.copy_(torch.randn(mlp.router.weight.shape, generator=g) * 0.15)
            mlp.router.bias.copy_(torch.randn(e, generator=g) * 0.5)
            ex = mlp.experts
            gu = ex.gate_up_proj  # [E, H, 2I]: gate columns 0, 2, 4, ..., up columns 1, 3, 5, ...
            gu.copy_(torch.randn(gu.shape, generator=g) * HIDDEN ** -0.5)
            gu[:, :, 0::2] *= (0.5 * 16 ** torch.rand(e, generator=g)).view(e, 1, 1)
            gu[:, :, 1::2] *= (0.5 * 16 ** torch.rand(e, generator=g)).view(e, 1, 1)
            ex.gate_up_proj_bias.copy_(torch.randn(ex.gate_up_proj_bias.shape, generator=g) * 1.5)
            ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * MOE_INTER ** -0.5)
            ex.down_proj_bias.copy_(torch.randn(ex.down_proj_bias.shape, generator=g) * 0.5)
    return model.eval(), cfg


V4_VOCAB = 128


def build_model_v4(spec: dict):
    """A tiny random DeepseekV4 (sliding-window attention only, 2 hyper-connection streams):
    layer 0 ``hash_moe`` with a random ``tid2eid`` table (distinct experts per token id),
    layer 1 ``moe`` with a spread ``e_score_correction_bias``. Gate and up rows are scaled per
    expert (0.5x-8x), and the shared expert's by 5x, so that some pre-activations pass
    ``swiglu_limit`` (the clamp bites on some rows, on both sides for ``up``)."""
    from transformers import AutoModelForCausalLM, DeepseekV4Config

    torch.manual_seed(spec["seed"])
    cfg = DeepseekV4Config(
        vocab_size=V4_VOCAB, hidden_size=HIDDEN, moe_intermediate_size=MOE_INTER, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        layer_types=["sliding_attention"] * LAYERS, mlp_layer_types=["hash_moe"] + ["moe"] * (LAYERS - 1),
        hc_mult=2, sliding_window=16, index_n_heads=2, index_head_dim=16, index_topk=4,
        n_routed_experts=spec["experts"], num_experts_per_tok=spec["top_k"], n_shared_experts=1,
        routed_scaling_factor=spec["routed_scaling_factor"], swiglu_limit=spec["swiglu_limit"],
        max_position_embeddings=128, num_nextn_predict_layers=0, tie_word_embeddings=False,
    )
    cfg.architectures = ["DeepseekV4ForCausalLM"]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(spec["seed"] + 1000)
    e, k = spec["experts"], spec["top_k"]
    with torch.no_grad():
        for layer in model.model.layers:
            mlp = layer.mlp
            mlp.gate.weight.copy_(torch.randn(mlp.gate.weight.shape, generator=g) * 0.08)
            if mlp.is_hash:
                table = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(V4_VOCAB)])
                mlp.gate.tid2eid.copy_(table)
            else:
                # bf16 values: the float32 buffer is exported in bf16 by ModelOpt
                bias = (torch.randn(e, generator=g) * 0.1).to(torch.bfloat16).float()
                mlp.gate.e_score_correction_bias.copy_(bias)
            gu = mlp.experts.gate_up_proj  # [E, 2I, H]: gate rows then up rows
            gu.copy_(torch.randn(gu.shape, generator=g) * HIDDEN ** -0.5)
            gu[:, :MOE_INTER, :] *= (0.5 * 16 ** torch.rand(e, generator=g)).view(e, 1, 1)
            gu[:, MOE_INTER:, :] *= (0.5 * 16 ** torch.rand(e, generator=g)).view(e, 1, 1)
            dp = mlp.experts.down_proj
            dp.copy_(torch.randn(dp.shape, generator=g) * MOE_INTER ** -0.5)
            for lin in (mlp.shared_experts.gate_proj, mlp.shared_experts.up_proj):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 5 * HIDDEN ** -0.5)
            sd = mlp.shared_experts.down_proj
            sd.weight.copy_(torch.randn(sd.weight.shape, generator=g) * MOE_INTER ** -0.5)
    return model.eval(), cfg


def build_model_v3(spec: dict):
    """A tiny random DeepseekV3 with the interesting cases present: a spread
    ``e_score_correction_bias``, up rows scaled 0.1x-10x against gate rows per expert,
    a router strong enough that the scores differ."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig

    torch.manual_seed(spec["seed"])
    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, moe_intermediate_size=MOE_INTER,
        num_hidden_layers=LAYERS, first_k_dense_replace=0, num_attention_heads=2, num_key_value_heads=2,
        n_routed_experts=spec["experts"], num_experts_per_tok=spec["top_k"], n_shared_experts=1,
        n_group=spec["n_group"], topk_group=spec["topk_group"], norm_topk_prob=spec["norm_topk_prob"],
        routed_scaling_factor=spec["routed_scaling_factor"], max_position_embeddings=128, tie_word_embeddings=False,
    )
    if spec.get("arch") == "glm4_moe":
        cfg = Glm4MoeConfig(**common, head_dim=32, num_nextn_predict_layers=0)
        cfg.architectures = ["Glm4MoeForCausalLM"]
    else:
        cfg = DeepseekV3Config(**common, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                               v_head_dim=16, num_nextn_predict_layers=0)
        cfg.architectures = ["DeepseekV3ForCausalLM"]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(spec["seed"] + 1000)
    with torch.no_grad():
        for layer in model.model.layers:
            mlp = layer.mlp
            e = spec["experts"]
            mlp.gate.weight.copy_(torch.randn(mlp.gate.weight.shape, generator=g) * 0.08)
            mlp.gate.e_score_correction_bias.copy_(torch.randn(e, generator=g) * 0.05)
            gu = mlp.experts.gate_up_proj  # [E, 2I, H]: gate rows then up rows
            gu.copy_(torch.randn(gu.shape, generator=g) * HIDDEN ** -0.5)
            ratio = 10 ** (2 * torch.rand(e, generator=g) - 1)
            gu[:, MOE_INTER:, :] *= ratio.view(e, 1, 1)
            dp = mlp.experts.down_proj
            dp.copy_(torch.randn(dp.shape, generator=g) * MOE_INTER ** -0.5)
            for lin in (mlp.shared_experts.gate_proj, mlp.shared_experts.up_proj):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * HIDDEN ** -0.5)
            sd = mlp.shared_experts.down_proj
            sd.weight.copy_(torch.randn(sd.weight.shape, generator=g) * MOE_INTER ** -0.5)
    model = model.to(torch.bfloat16).eval()
    return model, cfg


def token_batches(seed: int, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(seed + 2000)
    calib = torch.randint(0, vocab, (CALIB_SEQS, CALIB_LEN), generator=g)
    test = torch.randint(0, vocab, (TEST_SEQS, TEST_LEN), generator=g)
    return calib, test


def capture_moe_inputs(model, tokens) -> dict[int, torch.Tensor]:
    """The hidden states that reach each MoE block on ``tokens`` (forward hooks)."""
    return {i: x for i, (x, _) in capture_moe_calls(model, tokens).items()}


def capture_moe_calls(model, tokens) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """``(hidden states [T, H], input_ids [T] or None)`` that reach each MoE block on
    ``tokens`` (forward pre-hooks; DeepSeek-V4's blocks get the token ids as ``input_ids``)."""
    seen: dict[int, tuple] = {}
    hooks = []

    def grab(i, mod, args, kwargs):
        x = (args[0] if args else kwargs["hidden_states"]).detach().reshape(-1, HIDDEN).clone()
        ids = kwargs.get("input_ids")
        seen[i] = (x, None if ids is None else ids.detach().reshape(-1).clone())

    for i, mlp in enumerate(moe_blocks(model)):
        hooks.append(mlp.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: grab(i, mod, args, kwargs), with_kwargs=True))
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    return seen


def _run_gate(mlp, x, input_ids):
    """``(router_logits, topk_weights, topk_ids)`` of the block's router, as the block uses them."""
    if getattr(mlp, "is_hash", False):
        return mlp.gate(x, input_ids)
    if getattr(getattr(mlp, "router", None), "bias", None) is not None:
        return mlp.router(x)  # gpt-oss: logits (+ the router bias), softmax over the top-k logits
    if hasattr(mlp, "router"):  # Llama 4: top-k of the logits, sigmoid of the chosen ones
        scores, logits = mlp.router(x)
        ids = torch.topk(logits, mlp.top_k, dim=1).indices
        return logits, scores.gather(1, ids), ids
    if hasattr(mlp, "e_score_correction_bias") and not hasattr(mlp.gate, "e_score_correction_bias"):
        return mlp.gate(x, mlp.e_score_correction_bias)  # MiniMax-M2: the block holds the bias
    return mlp.gate(x)


def _run_shared(mlp, x):
    """The block's shared expert alone, as the block adds it (zeros without one)."""
    if hasattr(mlp, "shared_expert_gate"):  # Qwen2-MoE
        return torch.sigmoid(mlp.shared_expert_gate(x)) * mlp.shared_expert(x)
    if hasattr(mlp, "shared_expert"):
        return mlp.shared_expert(x)
    if hasattr(mlp, "shared_experts"):
        return mlp.shared_experts(x)
    return torch.zeros_like(x)


def _run_block(mlp, x, input_ids):
    if input_ids is None:
        out = mlp(x.unsqueeze(0))
    else:
        out = mlp(x.unsqueeze(0), input_ids=input_ids.unsqueeze(0))
    if isinstance(out, tuple):  # Llama 4 returns (output, router_logits)
        out = out[0]
    return out.reshape(x.shape)


def record_layer(mlp, x: torch.Tensor, out: dict, key: str, mlp32=None, input_ids=None) -> None:
    """The HF router's choice and the (fake-quantized) MoE block's output on ``x``; with
    ``mlp32`` (the same calibrated block in float32) also its float32 forward ``y_fp32``.
    With ``input_ids`` (DeepSeek-V4) the token ids too; for DeepSeek-V4 and gpt-oss the float32
    block's router choice (``*_fp32``: transformers computes their router logits in the model's
    dtype, so the bf16 model's choice may differ on a near-tie)."""
    with torch.no_grad():
        logits, tw, ti = _run_gate(mlp, x, input_ids)
        y = _run_block(mlp, x, input_ids)
        y_shared = _run_shared(mlp, x)
    out[f"{key}.x"] = x.contiguous()
    if input_ids is not None:
        out[f"{key}.input_ids"] = input_ids.to(torch.int64).contiguous()
    out[f"{key}.router_logits"] = logits.float().contiguous()
    out[f"{key}.topk_ids"] = ti.to(torch.int32).contiguous()
    out[f"{key}.topk_weights"] = tw.float().contiguous()
    out[f"{key}.y"] = y.contiguous()
    out[f"{key}.y_shared"] = y_shared.contiguous()
    if mlp32 is not None:
        with torch.no_grad():
            out[f"{key}.y_fp32"] = _run_block(mlp32, x.float(), input_ids).contiguous()
            if input_ids is not None or getattr(getattr(mlp, "router", None), "bias", None) is not None:
                logits32, tw32, ti32 = _run_gate(mlp32, x.float(), input_ids)
                out[f"{key}.router_logits_fp32"] = logits32.float().contiguous()
                out[f"{key}.topk_ids_fp32"] = ti32.to(torch.int32).contiguous()
                out[f"{key}.topk_weights_fp32"] = tw32.float().contiguous()


def write_fixture(name: str, spec: dict, ckpt_dir: Path, ref: dict, meta: dict, out_root: Path) -> Path:
    from safetensors.torch import save_file

    dst = out_root / name
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in sorted(ckpt_dir.iterdir()):
        if f.suffix in (".safetensors", ".json", ".yaml") and not f.name.startswith("tokenizer"):
            shutil.copy2(f, dst / f.name)
    save_file({k: v.contiguous() for k, v in ref.items()}, str(dst / "reference.safetensors"))
    (dst / "fixture.json").write_text(json.dumps({"name": name, **meta, "spec": spec}, indent=1, sort_keys=True) + "\n")
    return dst


# ------------------------------------------------------------------------------------------
# ModelOpt
# ------------------------------------------------------------------------------------------

def _modelopt_cpu_quantizer():
    """ModelOpt's dynamic NVFP4 block fake-quant on the CPU, from its own NVFP4QTensor."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    def fake_quant(inputs, block_size, amax, bias, num_bits, scale_bits, *rest):
        assert tuple(num_bits) == (2, 1) and tuple(scale_bits) == (4, 3), (num_bits, scale_bits)
        gs2 = amax.float().amax() / (6.0 * 448.0)
        qt, sf, gs = NVFP4QTensor.quantize(inputs.float(), block_size, None, gs2)
        deq = qt.dequantize(dtype=torch.float32, scale=sf, double_scale=gs, block_sizes={-1: block_size})
        return deq.to(inputs.dtype)

    return fake_quant


def run_modelopt(name: str, spec: dict, out_root: Path, work: Path) -> Path:
    import modelopt
    import modelopt.torch.quantization as mtq
    import modelopt.torch.quantization.nn.modules.tensor_quantizer as tq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    model, _ = build_model(spec)
    calib, test = token_batches(spec["seed"], V4_VOCAB if spec.get("arch") == "deepseek_v4" else VOCAB)
    qcfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    if spec["shared"] == "bf16":
        qcfg["quant_cfg"].append({"quantizer_name": "*shared_expert*", "enable": False})
    # left unquantized: Qwen2-MoE's shared-expert gate (one output row), Kimi-K2.5's vision tower
    for rule in ("*shared_expert_gate*", "*vision_tower*", "*mm_projector*"):
        qcfg["quant_cfg"].append({"quantizer_name": rule, "enable": False})

    def forward_loop(m):
        with torch.no_grad():
            for row in calib:
                m(row.unsqueeze(0))

    mtq.quantize(model, qcfg, forward_loop)
    tq.dynamic_block_quant = _modelopt_cpu_quantizer()  # CPU stand-in for the CUDA kernel
    # The exporter's first step: modules that share an input (the shared expert's gate and
    # up) get one input amax and one weight amax. Done here, before the recorded forward,
    # so that the forward is the one of the model the exporter writes.
    requantize_resmooth_fused_llm_layers(model)

    calls = capture_moe_calls(model, test)
    model32 = copy.deepcopy(model).float()
    ref: dict[str, torch.Tensor] = {}
    for i, (mlp, mlp32) in enumerate(zip(moe_blocks(model), moe_blocks(model32))):
        key, (x, input_ids) = f"layers.{i}", calls[i]
        record_layer(mlp, x, ref, key, mlp32, input_ids)
        if spec.get("arch") in NO_ACT_BYTES:
            continue
        experts = mlp.experts
        # the activation quantization the tool does, with its own function and scales
        e = int(ref[f"{key}.topk_ids"][0, 0])
        gs1 = NVFP4QTensor.get_activation_scaling_factor(experts.gate_up_proj_input_quantizer)
        qt, sf, _ = NVFP4QTensor.quantize(x.float(), 16, None, gs1)
        ref[f"{key}.act1.data"], ref[f"{key}.act1.scale"] = qt._quantized_data.contiguous(), sf.contiguous()
        ref[f"{key}.act1.global_scale"] = gs1.reshape(()).float()
        # the second GEMM's input for expert e, as the tool computes it (fake-quant first GEMM)
        tok = (ref[f"{key}.topk_ids"] == e).any(-1).nonzero().flatten()
        captured = {}
        orig = experts.down_proj_input_quantizer.forward

        def grab(inp, orig=orig):
            captured.setdefault("h", inp.detach().clone())
            return orig(inp)

        experts.down_proj_input_quantizer.forward = grab
        with torch.no_grad():
            experts(x[tok], torch.full((len(tok), 1), e, dtype=torch.long), torch.ones(len(tok), 1, dtype=x.dtype))
        experts.down_proj_input_quantizer.forward = orig
        h = captured["h"]
        gs2 = NVFP4QTensor.get_activation_scaling_factor(experts.down_proj_input_quantizer)
        qt2, sf2, _ = NVFP4QTensor.quantize(h.float(), 16, None, gs2)
        ref[f"{key}.act2.input"], ref[f"{key}.act2.expert"] = h.contiguous(), torch.tensor(e, dtype=torch.int32)
        ref[f"{key}.act2.data"], ref[f"{key}.act2.scale"] = qt2._quantized_data.contiguous(), sf2.contiguous()
        ref[f"{key}.act2.global_scale"] = gs2.reshape(()).float()
        ref[f"{key}.act1.expert"] = torch.tensor(e, dtype=torch.int32)

    ckpt = work / name
    if ckpt.exists():
        shutil.rmtree(ckpt)
    export_hf_checkpoint(model, export_dir=str(ckpt))
    meta = {"producer": "nvidia-modelopt", "producer_version": modelopt.__version__,
            "transformers_version": transformers.__version__, "torch_version": torch.__version__,
            "forward": "ModelOpt fake-quant forward of the calibrated model (bf16; y_fp32: a float32 copy) after "
                       "the exporter's requantize_resmooth_fused_llm_layers; dynamic NVFP4 block quantizer "
                       "evaluated with ModelOpt's NVFP4QTensor.quantize/dequantize on CPU",
            "act_quantize": "modelopt NVFP4QTensor.quantize(x, 16, None, input_scale)"}
    return write_fixture(name, spec, ckpt, ref, meta, out_root)


# ------------------------------------------------------------------------------------------
# llmcompressor / compressed-tensors
# ------------------------------------------------------------------------------------------

def _ct_quantize_bytes(mod, inp: torch.Tensor):
    """compressed-tensors' own NVFP4 activation quantization of ``inp`` as module ``mod``'s
    input quantizer does it (dynamic local block scales, the stored global scale): block
    scales from its ``compute_dynamic_scales_and_zp``, codes from its ``quantize`` and
    ``pack_fp4_to_uint8``. Returns ``(packed uint8 [T, K/2], scales e4m3 [T, K/16])``."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = mod.quantization_scheme.input_activations
    gsc = mod.input_global_scale
    with torch.no_grad():
        scale, zp = compute_dynamic_scales_and_zp(value=inp, args=args, module=mod, global_scale=gsc)
        q = quantize(inp, scale, zp, args, global_scale=gsc)
    return pack_fp4_to_uint8(q.reshape(-1, inp.shape[-1])), scale.reshape(inp.shape[0], -1).to(torch.float8_e4m3fn)


def run_llmcompressor(name: str, spec: dict, out_root: Path, work: Path) -> Path:
    import compressed_tensors
    import llmcompressor
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model, cfg = build_model(spec)
    calib, test = token_batches(spec["seed"], V4_VOCAB if spec.get("arch") == "deepseek_v4" else VOCAB)
    cfg_dir = work / f"{name}-config"
    if cfg_dir.exists():
        shutil.rmtree(cfg_dir)
    model.config.save_pretrained(cfg_dir)
    model.config._name_or_path = str(cfg_dir)
    tok = _offline_tokenizer(cfg_dir)
    ds = Dataset.from_dict({"input_ids": [r.tolist() for r in calib],
                            "attention_mask": [[1] * CALIB_LEN for _ in calib]})
    # routers (mlp.gate, Llama 4's feed_forward.router), Qwen2-MoE's shared-expert gate and
    # Kimi-K2.5's vision tower stay unquantized
    ignore = ["lm_head", "re:.*mlp.gate$", "re:.*router$", "re:.*shared_expert_gate$", "re:.*vision_tower.*",
              "re:.*mm_projector.*"]
    if spec["shared"] == "bf16":
        ignore.append("re:.*shared_expert.*")
    if spec.get("arch") == "kimi_k25":
        # transformers' save reverts Kimi-K2.5's vision rope permutation on every q_proj/k_proj,
        # the text model's quantized scales included (and fails on them): attention stays bf16
        ignore.append("re:.*self_attn.*")
    recipe = QuantizationModifier(targets="Linear", scheme=spec["scheme"], ignore=ignore)
    if spec.get("arch") == "llama4_text":
        _llama4_text_config_view()
    oneshot(model=model, dataset=ds, recipe=recipe, processor=tok, num_calibration_samples=CALIB_SEQS,
            max_seq_length=CALIB_LEN)
    calls = capture_moe_calls(model, test)
    model32 = copy.deepcopy(model).float()
    ref: dict[str, torch.Tensor] = {}
    for i, (mlp, mlp32) in enumerate(zip(moe_blocks(model), moe_blocks(model32))):
        key, (x, input_ids) = f"layers.{i}", calls[i]
        record_layer(mlp, x, ref, key, mlp32, input_ids)
        if spec.get("arch") not in NO_ACT_BYTES:
            _ct_activation_bytes(mlp, x, ref, key, spec)
    ckpt = work / name
    if ckpt.exists():
        shutil.rmtree(ckpt)
    if spec.get("arch") == "deepseek_v4":
        # oneshot split the fused experts into per-expert Linear modules; the save mapping
        # that llmcompressor's load_quantizable_moe registers for them (its loader itself is
        # not used: it imports every transformers model module) gives DeepSeek's upstream
        # names, as a V4 checkpoint loaded that way is saved: ffn.experts.E.w1/w3/w2,
        # ffn.gate.bias, ffn.shared_experts.w1/w3/w2.
        from llmcompressor.modeling.moe.conversion_mappings import (get_linearize_load_mappings,
                                                                    set_save_conversion_mapping)

        set_save_conversion_mapping(model, get_linearize_load_mappings("deepseek_v4")[2])
    model.save_pretrained(ckpt, save_compressed=True)
    meta = {"producer": "llmcompressor", "producer_version": llmcompressor.__version__,
            "compressed_tensors_version": compressed_tensors.__version__,
            "transformers_version": transformers.__version__, "torch_version": torch.__version__,
            "forward": "compressed-tensors fake-quant forward of the calibrated model (bf16, CPU; y_fp32: a "
                       "float32 copy)",
            "act_quantize": "compressed-tensors quantize() + pack_fp4_to_uint8 with the stored global scale"}
    return write_fixture(name, spec, ckpt, ref, meta, out_root)


def _llama4_text_config_view():
    """llmcompressor's Llama 4 expert linearization reads ``config.text_config`` (the
    multimodal Llama4Config); a text-only model's config is its own text config."""
    import types

    from llmcompressor.modeling.moe import llama4 as l4

    orig = l4.Llama4LinearExperts.from_experts_module.__func__
    if getattr(orig, "_text_view", False):
        return

    def from_experts_module(cls, experts, config):
        if not hasattr(config, "text_config"):
            config = types.SimpleNamespace(text_config=config)
        return orig(cls, experts, config)

    from_experts_module._text_view = True
    l4.Llama4LinearExperts.from_experts_module = classmethod(from_experts_module)


def _offline_tokenizer(cfg_dir: Path):
    """A word-level tokenizer made here (nothing downloaded); only its presence matters."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", pad_token="t0", eos_token="t1")
    fast.save_pretrained(cfg_dir)
    return fast


def _ct_activation_bytes(mlp, x, ref, key, spec):
    if spec["scheme"] != "NVFP4":
        return
    e = int(ref[f"{key}.topk_ids"][0, 0])
    expert = mlp.experts[e]
    ref[f"{key}.act1.expert"] = torch.tensor(e, dtype=torch.int32)
    ref[f"{key}.act1.data"], ref[f"{key}.act1.scale"] = _ct_quantize_bytes(expert.gate_proj, x)
    ref[f"{key}.act1.global_scale_divisor"] = expert.gate_proj.input_global_scale.detach().float().reshape(())
    up_data, up_scale = _ct_quantize_bytes(expert.up_proj, x)
    ref[f"{key}.act1.up_data"], ref[f"{key}.act1.up_scale"] = up_data, up_scale
    captured = {}
    hook = expert.down_proj.register_forward_pre_hook(lambda m, a: captured.setdefault("h", a[0].detach().clone()))
    tok = (ref[f"{key}.topk_ids"] == e).any(-1).nonzero().flatten()
    with torch.no_grad():
        mlp.experts(x[tok], torch.full((len(tok), 1), e, dtype=torch.long), torch.ones(len(tok), 1, dtype=x.dtype))
    hook.remove()
    h = captured["h"]
    ref[f"{key}.act2.expert"] = torch.tensor(e, dtype=torch.int32)
    ref[f"{key}.act2.input"] = h.contiguous()
    ref[f"{key}.act2.data"], ref[f"{key}.act2.scale"] = _ct_quantize_bytes(expert.down_proj, h)
    ref[f"{key}.act2.global_scale_divisor"] = expert.down_proj.input_global_scale.detach().float().reshape(())


# ------------------------------------------------------------------------------------------
# routing of each architecture megamoe claims, from transformers' own router modules
# ------------------------------------------------------------------------------------------

ROUTERS = {
    # name: (model_type, config kwargs)
    "routing_deepseek_v3": ("deepseek_v3", dict(n_routed_experts=12, num_experts_per_tok=3, n_group=4, topk_group=2,
                                                norm_topk_prob=True, routed_scaling_factor=2.5)),
    "routing_deepseek_v3_nonorm": ("deepseek_v3", dict(n_routed_experts=10, num_experts_per_tok=2, n_group=1,
                                                       topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)),
    "routing_mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
    "routing_qwen3_moe": ("qwen3_moe", dict(num_experts=10, num_experts_per_tok=4, norm_topk_prob=True)),
    "routing_qwen3_moe_nonorm": ("qwen3_moe", dict(num_experts=10, num_experts_per_tok=4, norm_topk_prob=False)),
    "routing_glm4_moe": ("glm4_moe", dict(n_routed_experts=12, num_experts_per_tok=3, n_group=4, topk_group=2,
                                          norm_topk_prob=True, routed_scaling_factor=2.5)),
    "routing_glm4_moe_nogroups": ("glm4_moe", dict(n_routed_experts=10, num_experts_per_tok=4, n_group=1,
                                                   topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)),
    # DeepSeek-V4: layer 0 hash-routed (tid2eid), layer 1 top-k; in float32 (transformers computes
    # V4's logits and scores in the model's dtype; megamoe is compared with the float32 model)
    "routing_deepseek_v4_hash": ("deepseek_v4", dict(n_routed_experts=12, num_experts_per_tok=4, num_hidden_layers=2,
                                                     mlp_layer_types=["hash_moe", "moe"], vocab_size=64,
                                                     routed_scaling_factor=1.5, layer=0)),
    "routing_deepseek_v4": ("deepseek_v4", dict(n_routed_experts=12, num_experts_per_tok=4, num_hidden_layers=2,
                                                mlp_layer_types=["hash_moe", "moe"], vocab_size=64,
                                                routed_scaling_factor=2.5, layer=1)),
    # (appended: each router's seed is its position, so those above stay as recorded)
    "routing_kimi_k25": ("kimi_k25", dict(text_config=dict(model_type="deepseek_v3", hidden_size=HIDDEN,
                                                           n_routed_experts=12, num_experts_per_tok=3, n_group=4,
                                                           topk_group=2, norm_topk_prob=True,
                                                           routed_scaling_factor=2.5))),
    "routing_minimax_m2": ("minimax_m2", dict(num_local_experts=10, num_experts_per_tok=3)),
    "routing_qwen2_moe": ("qwen2_moe", dict(num_experts=10, num_experts_per_tok=4, norm_topk_prob=False)),
    "routing_qwen2_moe_norm": ("qwen2_moe", dict(num_experts=10, num_experts_per_tok=4, norm_topk_prob=True)),
    "routing_llama4_text": ("llama4_text", dict(num_local_experts=8, num_experts_per_tok=1)),
    "routing_llama4": ("llama4", dict(text_config=dict(hidden_size=HIDDEN, num_local_experts=8,
                                                       num_experts_per_tok=2))),
    # gpt-oss: the router's bias added to the logits, softmax over the top-k logits; in float32
    # (transformers computes the logits and the softmax in the model's dtype)
    "routing_gpt_oss": ("gpt_oss", dict(num_local_experts=10, num_experts_per_tok=4)),
}


def run_routing(out_root: Path) -> list[Path]:
    """Each claimed architecture's transformers router on random bf16 hidden states:
    ``router_logits``, ``topk_ids``, ``topk_weights``, with the config.json it implies in the
    file's metadata (``config``)."""
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoConfig

    made = []
    for n, (name, (model_type, kw)) in enumerate(ROUTERS.items()):
        torch.manual_seed(500 + n)
        kw = dict(kw)
        layer = kw.pop("layer", None)
        if "text_config" in kw:  # a multimodal wrapper: the router is the text model's
            cfg = AutoConfig.for_model(model_type, **kw)
        else:
            cfg = AutoConfig.for_model(model_type, hidden_size=HIDDEN, **kw)
        rcfg = getattr(cfg, "text_config", cfg)
        dtype = torch.float32 if model_type in ("deepseek_v4", "gpt_oss") else torch.bfloat16
        if model_type in ("deepseek_v3", "kimi_k25"):
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as R
        elif model_type == "glm4_moe":
            from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as R
        elif model_type == "deepseek_v4":
            from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

            R = v4.DeepseekV4HashRouter if cfg.mlp_layer_types[layer] == "hash_moe" else v4.DeepseekV4TopKRouter
        elif model_type == "mixtral":
            from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as R
        elif model_type == "minimax_m2":
            from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter as R
        elif model_type == "qwen2_moe":
            from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter as R
        elif model_type in ("llama4", "llama4_text"):
            from transformers.models.llama4.modeling_llama4 import Llama4Router as R
        elif model_type == "gpt_oss":
            from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter as R
        else:
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as R
        router = R(rcfg)
        e_bias = None
        if model_type == "minimax_m2":  # the block's buffer, passed to the router
            e_bias = torch.randn(rcfg.num_local_experts) * 0.05
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape) * 0.1)
            if hasattr(router, "e_score_correction_bias"):
                router.e_score_correction_bias.copy_(torch.randn(router.e_score_correction_bias.shape) * 0.05)
            if model_type == "gpt_oss":  # the router's own bias, spread: it moves choices and weights
                router.bias.copy_(torch.randn(router.bias.shape) * 0.5)
            if hasattr(router, "tid2eid"):  # distinct experts per token id
                e = router.weight.shape[0]
                router.tid2eid.copy_(torch.stack([torch.randperm(e)[:router.top_k] for _ in range(cfg.vocab_size)]))
        router = router.to(dtype)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.data = router.e_score_correction_bias.data.float()
        x = torch.randn(64, HIDDEN).to(dtype)
        input_ids = torch.randint(0, cfg.vocab_size, (64,)) if hasattr(router, "tid2eid") else None
        with torch.no_grad():
            if e_bias is not None:
                logits, weights, ids = router(x, e_bias)
            elif model_type in ("llama4", "llama4_text"):
                # Llama4Router returns sigmoid scores [T, E] (0 where not chosen) and the logits;
                # the chosen experts are the top-k of the logits
                scores, logits = router(x)
                ids = torch.topk(logits, router.top_k, dim=1).indices
                weights = scores.gather(1, ids)
            else:
                logits, weights, ids = router(x) if input_ids is None else router(x, input_ids)
        t = {"router_logits": logits.float().contiguous(), "topk_ids": ids.to(torch.int32).contiguous(),
             "topk_weights": weights.float().contiguous()}
        if hasattr(router, "e_score_correction_bias"):
            t["e_score_correction_bias"] = router.e_score_correction_bias.float().contiguous()
        if e_bias is not None:
            t["e_score_correction_bias"] = e_bias.float().contiguous()
        if input_ids is not None:
            t["input_ids"], t["tid2eid"] = input_ids.contiguous(), router.tid2eid.contiguous()
        meta = {"config": cfg.to_json_string(use_diff=False), "transformers_version": transformers.__version__,
                "router": R.__name__, "dtype": str(dtype).replace("torch.", "")}
        if layer is not None:
            meta["layer"] = str(layer)
        dst = out_root / f"{name}.safetensors"
        save_file(t, str(dst), metadata=meta)
        made.append(dst)
    return made


# ------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("producer", choices=("modelopt", "llmcompressor", "routing", "all"))
    p.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "real"))
    p.add_argument("--work", default=None, help="scratch folder for the tools' raw output (default: a temp dir)")
    p.add_argument("--only", nargs="*", default=None, help="fixture names (default: every one of the producer)")
    args = p.parse_args(argv)
    import tempfile

    torch.set_num_threads(1)
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="megamoe-fixtures-"))
    runners = {"modelopt": run_modelopt, "llmcompressor": run_llmcompressor}
    wanted = [args.producer] if args.producer != "all" else [
        p for p, mod in (("modelopt", "modelopt"), ("llmcompressor", "llmcompressor")) if _importable(mod)]
    made = []
    if args.producer in ("routing", "all"):
        made += run_routing(out_root)
        for m in made:
            print(f"   -> {m}", flush=True)
    for name, spec in FIXTURES.items():
        if spec["producer"] not in wanted or (args.only and name not in args.only):
            continue
        print(f"== {name} ({spec['producer']}, {spec['scheme']}, shared expert {spec['shared']})", flush=True)
        made.append(runners[spec["producer"]](name, spec, out_root, work))
        print(f"   -> {made[-1]}", flush=True)
    if not made:
        print("nothing made", file=sys.stderr)
        return 1
    return 0


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    sys.exit(main())
