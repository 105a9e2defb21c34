"""Shared by tests/test_distributed.py (gloo, CPU) and tests/gpu/test_distributed_nccl.py (NCCL):
the checkpoints, the per-rank cases, the front-end batches, and the launcher of one group
of real processes (tests/dist_ep_worker.py). Not a test module.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

PRESET_OVERRIDES = dict(scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        n_shared_experts=1, shared_intermediate_size=64)
EXPERT_TENSORS = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w13_input_scale",
                  "w2_weight", "w2_weight_scale", "w2_weight_scale_2", "w2_input_scale")
PREFIX = "model.layers.3.mlp."
#: cases run with other layer settings: config overrides (both sides), and the EP layer's combine dtype
VARIANTS = {
    "w4a16": ({"act_mode": "w4a16"}, torch.float32),
    "dynamic_scales": ({"dynamic_act_scale": True}, torch.float32),
    "swiglu_limit": ({"swiglu_limit": 0.5}, torch.float32),
    "bf16_combine": ({}, torch.bfloat16),
}


#: MoEWeights fields that cover every expert or none: replicated on every rank, never sliced
REPLICATED_FIELDS = ("router_weight", "router_bias", "shared_gate_up", "shared_down", "shared_gate_up_input_scale",
                     "shared_down_input_scale")


def weight_tensors(weights) -> dict:
    """Every tensor of a MoEWeights by field (NVFP4 fields as ``w13.data``, ``w13.scale``,
    ``w13.global_scale``); fp8 scales viewed as bytes so ``torch.equal`` compares bits."""
    from dataclasses import fields

    from megamoe.nvfp4 import NVFP4Tensor

    out = {}
    for f in fields(weights):
        v = getattr(weights, f.name)
        parts = {f"{f.name}.{p}": getattr(v, p) for p in ("data", "scale", "global_scale")} \
            if isinstance(v, NVFP4Tensor) else {f.name: v}
        for name, t in parts.items():
            if t is not None:
                out[name] = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    return out


def assert_is_expert_slice(shard: dict, full: dict, start: int, end: int, what: str) -> None:
    """Every per-expert tensor of ``shard`` is experts [start, end) of ``full`` (0-d scales whole),
    the replicated ones are whole, and nothing is missing or extra."""
    assert sorted(shard) == sorted(full), f"{what}: tensors {sorted(shard)} vs {sorted(full)}"
    for name, t in full.items():
        replicated = name.split(".")[0] in REPLICATED_FIELDS or t.dim() == 0
        want = t if replicated else t[start:end]
        assert torch.equal(shard[name], want), f"{what}: {name} is not {'whole' if replicated else f'experts [{start}, {end})'}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_per_expert(path, weights, cfg) -> None:
    """The same weights in ModelOpt's per-expert Hugging Face naming (under a layer prefix)."""
    import json

    from safetensors.torch import save_file

    i = cfg.intermediate_size
    t = {}
    for e in range(cfg.num_experts):
        for proj, rows, gs_col in (("gate", slice(0, i), 0), ("up", slice(i, 2 * i), 1)):
            base = f"{PREFIX}experts.{e}.{proj}_proj."
            t[base + "weight"] = weights.w13.data[e, rows]
            t[base + "weight_scale"] = weights.w13.scale[e, rows]
            t[base + "weight_scale_2"] = weights.w13.global_scale[e, gs_col].reshape(())
            t[base + "input_scale"] = weights.w13_input_scale[e].reshape(())
        base = f"{PREFIX}experts.{e}.down_proj."
        t[base + "weight"] = weights.w2.data[e]
        t[base + "weight_scale"] = weights.w2.scale[e]
        t[base + "weight_scale_2"] = weights.w2.global_scale[e].reshape(())
        t[base + "input_scale"] = weights.w2_input_scale[e].reshape(())
    t[PREFIX + "gate.weight"] = weights.router_weight
    t[PREFIX + "gate.e_score_correction_bias"] = weights.router_bias
    t[PREFIX + "shared_experts.gate_up_proj.weight"] = weights.shared_gate_up
    t[PREFIX + "shared_experts.down_proj.weight"] = weights.shared_down
    save_file({k: v.contiguous().clone() for k, v in t.items()}, str(path),
              metadata={"megamoe.config": json.dumps(cfg.to_dict())})


def _cases(world: int, cfg, gen: torch.Generator) -> dict:
    """Per case, per rank: the rank's tokens (and routing when the caller gives it)."""
    h, e, k = cfg.hidden_size, cfg.num_experts, cfg.top_k
    per = e // world

    def x(t, dtype=torch.bfloat16):
        return (torch.randn((t, h), generator=gen) * 2).to(dtype)

    def topk(t, low=0, high=e):
        ids = torch.stack([torch.randperm(high - low, generator=gen)[:k] + low for _ in range(t)]) if t else \
            torch.zeros((0, k), dtype=torch.long)
        w = torch.rand((t, k), generator=gen) + 0.05
        return ids.to(torch.int32), w / w.sum(1, keepdim=True)

    cases: dict = {name: [] for name in ("router_bf16", "router_fp32", "topk_fp32", "logits_bf16", "all_to_rank0",
                                         "one_expert", "T1", "prime_T", "masked", *VARIANTS)}
    prime_t = [97, 0, 13, 2][:world]
    for r in range(world):
        t = (37, 53, 41, 29)[r]
        cases["router_bf16"].append({"x": x(t)})
        cases["router_fp32"].append({"x": x(t + 11, torch.float32)})
        ids, w = topk(t)
        cases["topk_fp32"].append({"x": x(t, torch.float32), "topk_ids": ids, "topk_weights": w})
        cases["logits_bf16"].append({"x": x(t), "router_logits": torch.randn((t, e), generator=gen)})
        # every token of every rank goes to rank 0's experts: the other ranks receive nothing
        ids, w = topk(t, 0, per)
        cases["all_to_rank0"].append({"x": x(t, torch.float32), "topk_ids": ids, "topk_weights": w})
        # one expert (on the last rank) gets every token; half the tokens name it twice
        ids, w = topk(t)
        ids[:, 0] = e - 1
        ids[: t // 2, 1] = e - 1
        ids[t // 2:, 1] = torch.randint(0, e - 1, (t - t // 2,), generator=gen).to(torch.int32)
        cases["one_expert"].append({"x": x(t, torch.float32), "topk_ids": ids, "topk_weights": w})
        # masked slots (id -1 or another id outside [0, E), docs/SPEC.md §3.1): skipped; one token with
        # every slot masked; unvalidated (validate=True rejects them from a caller)
        ids, w = topk(t)
        masked = torch.rand((t, k), generator=gen) < 0.4
        masked[0] = True
        bad = torch.tensor([-1, e, -3])[torch.randint(0, 3, (t, k), generator=gen)].to(torch.int32)
        cases["masked"].append({"x": x(t, torch.float32), "topk_ids": torch.where(masked, bad, ids),
                                "topk_weights": w, "validate": False})
        cases["T1"].append({"x": x(1, torch.float32)})
        cases["prime_T"].append({"x": x(prime_t[r], torch.float32)})
        for name in VARIANTS:
            cases[name].append({"x": x(t, torch.float32)})
    return cases


def _front_batches(cfg, gen: torch.Generator) -> list[dict]:
    """Batches for the service front end (rank 0 only): router, given top-k, logits with T=1 < world."""
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=gen)[: cfg.top_k] for _ in range(5)]).to(torch.int32)
    return [
        {"hidden_states": torch.randn((37, cfg.hidden_size), generator=gen).to(torch.bfloat16)},
        {"hidden_states": torch.randn((5, cfg.hidden_size), generator=gen), "topk_ids": ids,
         "topk_weights": torch.rand((5, cfg.top_k), generator=gen)},
        {"hidden_states": torch.randn((1, cfg.hidden_size), generator=gen),
         "router_logits": torch.randn((1, cfg.num_experts), generator=gen)},
    ]


def write_checkpoints(d: Path, seed: int) -> Path:
    """The fused checkpoint, the same weights per expert (with a layer prefix), and one with E=9."""
    from megamoe.checkpoint import synthetic_weights, write_synthetic
    from megamoe.presets import get_preset

    cfg = get_preset("tiny").with_(**PRESET_OVERRIDES)
    write_synthetic(d / "ckpt.safetensors", "tiny", seed=seed, **PRESET_OVERRIDES)
    _write_per_expert(d / "ckpt_per_expert.safetensors", synthetic_weights(cfg, seed=seed), cfg)
    write_synthetic(d / "ckpt_e9.safetensors", "tiny", seed=1, num_experts=9)
    return d


def launch(world: int, workdir: Path, cfg, gen: torch.Generator, dist_backend: str = "gloo",
           backend: str = "torch") -> tuple[dict, list[dict]]:
    """Write the cases, spawn ``world`` ranks once, return (cases, per-rank results)."""
    import dist_ep_worker

    cases = _cases(world, cfg, gen)
    torch.save(cases, workdir / f"cases_w{world}.pt")
    torch.save(_front_batches(cfg, gen), workdir / f"front_w{world}.pt")
    return cases, spawn_ranks(dist_ep_worker.run, world, workdir, "rank", dist_backend, backend)


def spawn_ranks(worker_run, world: int, workdir: Path, stem: str, dist_backend: str, backend: str) -> list[dict]:
    """``world`` processes of ``worker_run`` (one group); each writes ``workdir/{stem}{r}.pt``. Returns
    the per-rank results, or fails with every rank's traceback."""
    import torch.multiprocessing as mp

    for r in range(world):
        (workdir / f"{stem}{r}.pt").unlink(missing_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for var, off in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(var, off)  # NVLink multicast stays off
    try:
        mp.spawn(worker_run, args=(world, _free_port(), str(workdir), dist_backend, backend), nprocs=world, join=True)
    except Exception as exc:
        errors = []
        for r in range(world):
            f = workdir / f"{stem}{r}.pt"
            if f.exists():
                res = torch.load(f, weights_only=False)
                if res.get("error"):
                    errors.append(f"rank {r}:\n{res['error']}")
        raise AssertionError(f"worker processes failed: {exc}\n" + "\n".join(errors)) from None
    return [torch.load(workdir / f"{stem}{r}.pt", weights_only=False) for r in range(world)]


def single_process_outputs(single, per_rank: list[dict], overrides: dict | None = None) -> list[torch.Tensor]:
    """The single-process layer on all ranks' tokens of one case, concatenated; split back per rank."""
    if overrides:
        saved = single.config
        single.config = saved.with_(**overrides)
        try:
            return single_process_outputs(single, per_rank)
        finally:
            single.config = saved

    def cat(key):
        if per_rank[0].get(key) is None:
            return None
        return torch.cat([p[key] for p in per_rank])

    ref = single(cat("x"), topk_ids=cat("topk_ids"), topk_weights=cat("topk_weights"),
                 router_logits=cat("router_logits"), validate=per_rank[0].get("validate", True))
    return list(ref.cpu().split([p["x"].shape[0] for p in per_rank]))


# ------------------------------------------------------------------------------------------
# tensor parallelism (tests/dist_tp_worker.py)
# ------------------------------------------------------------------------------------------

#: DeepSeek-V4's semantics on the tiny shape (H 256, I 128, E 8, k 2): sqrt(softplus) scores with a
#: correction bias, SwiGLU clamped at 10, one shared expert of width 128 (16 per rank at TP = 8)
TP_OVERRIDES = dict(scoring="sqrtsoftplus", routed_scaling_factor=1.5, n_shared_experts=1,
                    shared_intermediate_size=128, swiglu_limit=10.0)
#: cases run with other layer settings (config overrides, both sides)
TP_VARIANTS = {
    "w4a16": {"act_mode": "w4a16"},
    "dynamic_scales": {"dynamic_act_scale": True},
    "swiglu_limit": {"swiglu_limit": 0.5},
}


def write_tp_checkpoints(d: Path, seed: int) -> Path:
    """``tp.safetensors`` (a top-k layer) and ``tp_hash.safetensors`` (the same weights, hash-routed:
    a tid2eid table); fused layout, megamoe's writer."""
    from megamoe.checkpoint import write_synthetic

    write_synthetic(d / "tp.safetensors", "tiny", seed=seed, **TP_OVERRIDES)
    write_synthetic(d / "tp_hash.safetensors", "tiny", seed=seed, hash_routing=True, **TP_OVERRIDES)
    return d


def tp_cases(cfg, gen: torch.Generator, vocab: int) -> dict:
    """One input per case: every rank runs it with the same tokens."""
    h, e, k = cfg.hidden_size, cfg.num_experts, cfg.top_k

    def x(t, dtype=torch.float32):
        return (torch.randn((t, h), generator=gen) * 2).to(dtype)

    def topk(t):
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
        w = torch.rand((t, k), generator=gen) + 0.05
        return ids, w / w.sum(1, keepdim=True)

    ids, w = topk(29)
    masked_ids, masked_w = topk(23)
    masked = torch.rand((23, k), generator=gen) < 0.4
    masked[0] = True
    cases = {
        "router_bf16": {"x": x(37, torch.bfloat16)},
        "router_fp32": {"x": x(48)},
        "topk_fp32": {"x": x(29), "topk_ids": ids, "topk_weights": w},
        "logits_fp32": {"x": x(31), "router_logits": torch.randn((31, e), generator=gen)},
        "masked": {"x": x(23), "topk_ids": torch.where(masked, torch.full_like(masked_ids, -1), masked_ids),
                   "topk_weights": masked_w, "validate": False},
        "T1": {"x": x(1)},
        "T0": {"x": x(0)},
        "prime_T": {"x": x(97)},
        "hash": {"x": x(41), "input_ids": torch.randint(0, vocab, (41,), generator=gen)},
    }
    for name in TP_VARIANTS:
        cases[name] = {"x": x(37)}
    return cases


def launch_tp(world: int, workdir: Path, cfg, gen: torch.Generator, dist_backend: str = "gloo",
              backend: str = "torch") -> tuple[dict, list[dict]]:
    """Write the TP cases, spawn ``world`` ranks once (tests/dist_tp_worker.py), return (cases, results)."""
    import dist_tp_worker
    from megamoe.checkpoint import SYNTHETIC_VOCAB

    cases = tp_cases(cfg, gen, SYNTHETIC_VOCAB)
    torch.save(cases, workdir / f"tp_cases_w{world}.pt")
    torch.save(_front_batches(cfg, gen), workdir / f"tp_front_w{world}.pt")
    return cases, spawn_ranks(dist_tp_worker.run, world, workdir, "tp_rank", dist_backend, backend)


def tp_single_output(single, case: dict, overrides: dict | None = None, reference: bool = False) -> torch.Tensor:
    """The single-process layer (or its bf16 reference) on one TP case."""
    saved = single.config
    if overrides:
        single.config = saved.with_(**overrides)
    try:
        fn = single.reference_bf16 if reference else single.forward
        kw = {k: case[k] for k in ("topk_ids", "topk_weights", "router_logits", "input_ids") if case.get(k) is not None}
        return fn(case["x"], validate=case.get("validate", True), **kw).cpu()
    finally:
        single.config = saved
