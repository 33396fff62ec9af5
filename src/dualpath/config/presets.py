"""Named presets (dicts of frozen configs): models, hardware, and the paper's cluster setups.

Numbers come from design §2, §10, §13. Where the paper is silent the value is marked
``# assumption`` with its reason, here beside the value; ``dualpath presets`` lists the presets
and docs/calibration.md explains the cost model's constants.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dualpath.config.cluster import ClusterConfig
from dualpath.config.hardware import HardwareConfig
from dualpath.config.model import ModelConfig
from dualpath.config.root import Config
from dualpath.config.scheduler import SchedulerConfig
from dualpath.config.sim import SimConfig
from dualpath.config.workload import WorkloadConfig

DS660B = ModelConfig(  # DeepSeek-V3.2 (671B total / 37B active), MLA + DSA sparse attention
    name="ds660b",
    attention="mla_sparse",
    num_layers=61,
    hidden_size=7168,
    num_heads=128,
    kv_lora_rank=512,
    qk_rope_dim=64,
    kv_dtype_bytes=1,
    kv_scale_bytes=16,
    sparse_topk=2048,
    indexer_heads=64,
    indexer_head_dim=128,
    active_params=37e9,
    total_params=671e9,
    num_routed_experts=256,
    experts_per_token=8,
    num_shared_experts=1,
    num_dense_layers=3,
    ffn_hidden_size=18432,
    moe_intermediate_size=2048,
    vocab_size=129280,
    max_context_tokens=131072,
    compute_dtype="fp8",
    weight_dtype_bytes=1.0,
)

DEEPSEEK_V3 = replace(  # dense MLA; KV in the same FP8 latent format as V3.2 (656 B/layer)
    DS660B, name="deepseek-v3", attention="mla"
)

DS27B = ModelConfig(  # downscaled V3.2 (design §10)
    name="ds27b",
    attention="mla_sparse",
    num_layers=30,
    hidden_size=2560,
    num_heads=32,  # assumption: the paper gives no head count; hidden 2560 / 80
    kv_lora_rank=512,
    qk_rope_dim=64,
    kv_dtype_bytes=1,
    kv_scale_bytes=16,
    sparse_topk=1024,
    indexer_heads=32,
    indexer_head_dim=64,
    active_params=4.4e9,
    total_params=27e9,
    num_routed_experts=72,
    experts_per_token=6,
    num_shared_experts=2,
    num_dense_layers=1,
    ffn_hidden_size=12288,
    moe_intermediate_size=1536,
    vocab_size=129280,
    max_context_tokens=131072,
    compute_dtype="fp8",
    weight_dtype_bytes=1.0,
)

QWEN32B = ModelConfig(  # Qwen2.5-32B: dense GQA, FP16 KV
    name="qwen32b",
    attention="gqa",
    num_layers=64,
    hidden_size=5120,
    num_heads=40,
    num_kv_heads=8,
    head_dim=128,
    kv_dtype_bytes=2,
    active_params=32.5e9,
    total_params=32.5e9,
    num_routed_experts=0,
    experts_per_token=0,
    num_shared_experts=0,
    num_dense_layers=64,
    ffn_hidden_size=27648,
    moe_intermediate_size=0,
    vocab_size=152064,
    max_context_tokens=131072,
    compute_dtype="bf16",
    weight_dtype_bytes=2.0,
)

TINY = ModelConfig(  # the CPU runtime's model: real weights from a seed, float32 KV
    name="tiny",
    attention="gqa",
    num_layers=4,
    hidden_size=256,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    kv_dtype_bytes=4,
    active_params=3.4e6,
    total_params=3.4e6,
    num_routed_experts=0,
    experts_per_token=0,
    num_shared_experts=0,
    num_dense_layers=4,
    ffn_hidden_size=688,
    moe_intermediate_size=0,
    vocab_size=1024,
    max_context_tokens=16384,
    compute_dtype="bf16",
    weight_dtype_bytes=4.0,
)

MODEL_PRESETS: dict[str, ModelConfig] = {
    "ds660b": DS660B,
    "deepseek-v3": DEEPSEEK_V3,
    "ds27b": DS27B,
    "qwen32b": QWEN32B,
    "tiny": TINY,
}

HOPPER = HardwareConfig()  # design §2, §10, §13.9: H800-class, 8 × 400 Gb/s CNIC, 1 SNIC

# One machine, emulated: engines are CPU processes; NIC pacers run at these rates (docs/runtime.md).
CPU_EMULATED = HardwareConfig(
    name="cpu-emulated",
    gpus_per_node=2,
    cnic_bytes_per_s=2e9,
    snic_per_node=1,
    snic_bytes_per_s=100e6,
    dram_bytes_per_s=10e9,
    hbm_bytes=2e9,
    hbm_bytes_per_s=20e9,
    gpu_bf16_flops=50e9,
    gpu_fp8_flops=50e9,
    pe_buffer_bytes=256e6,
    de_buffer_bytes=256e6,
    activation_reserve_bytes=0.1e9,
)

# The runtime as a testbed (``--gpu-time emulated``, docs/runtime.md "Emulated GPU time"): the
# NICs of ``cpu-emulated`` with an emulated GPU slower than one core of the 2-core development
# host, so that a pass, computed for real on a shared and busy host, still ends at the GPU's
# time, not the host's. Measured on that host by ``runtime.profile`` (one thread, load ≈ 3):
# a 512-token prefill 203 ms, 64 tokens after 2,048 cached 80 ms, a decode step of 8 × 2,048
# tokens 97 ms, of 1 × 256 tokens 12 ms. This GPU takes 436 / 98 / 146 / 14 ms for them.
CPU_TESTBED = replace(
    CPU_EMULATED,
    name="cpu-testbed",
    snic_bytes_per_s=10e6,  # storage-bound at the tiny model's sizes (docs/runtime.md)
    gpu_bf16_flops=20e9,  # × linear_mfu 0.45 = 9 GFLOP/s GEMMs; × attention_mfu 0.6 = 12
    gpu_fp8_flops=20e9,
    hbm_bytes_per_s=10e9,  # weights read per decode step at 8 GB/s (hbm_efficiency 0.8)
    kv_read_efficiency=0.05,  # decode attention reads KV at 0.5 GB/s (the host gathers pages)
    decode_step_overhead_s=0.010,  # per step: Python, sampling, the step's messages
)

HARDWARE_PRESETS: dict[str, HardwareConfig] = {
    "hopper": HOPPER,
    "cpu-emulated": CPU_EMULATED,
    "cpu-testbed": CPU_TESTBED,
}


def _setup(name: str, model: ModelConfig, p: int, d: int, ep: bool, **hw: Any) -> Config:
    return Config(
        name=name,
        hardware=replace(HOPPER, **hw) if hw else HOPPER,
        model=model,
        cluster=ClusterConfig(num_prefill_nodes=p, num_decode_nodes=d, prefill_ep=ep, decode_ep=ep),
        scheduler=SchedulerConfig(),
        workload=WorkloadConfig(),
    )


CLUSTER_PRESETS: dict[str, Config] = {
    "ds660b-2p4d": _setup("ds660b-2p4d", DS660B, 2, 4, True),
    # paper scale: 24 replicas of the 2P4D unit (EP16 prefill, EP32 decode), 1,152 GPUs
    "ds660b-48p96d": replace(
        _setup("ds660b-48p96d", DS660B, 48, 96, True),
        cluster=ClusterConfig(48, 96, prefill_ep_nodes=2, decode_ep_nodes=4),
    ),
    "ds27b-1p1d": _setup("ds27b-1p1d", DS27B, 1, 1, True),
    "ds27b-1p2d": _setup("ds27b-1p2d", DS27B, 1, 2, True),
    "ds27b-2p1d": _setup("ds27b-2p1d", DS27B, 2, 1, True),
    "qwen32b-1p2d": _setup(
        "qwen32b-1p2d", QWEN32B, 1, 2, False, pe_buffer_bytes=320e9, de_buffer_bytes=320e9
    ),
    "tiny-1p1d": Config(
        name="tiny-1p1d",
        hardware=CPU_EMULATED,
        model=TINY,
        cluster=ClusterConfig(1, 1, prefill_ep=False, decode_ep=False),
        scheduler=SchedulerConfig(),
        workload=WorkloadConfig(num_agents=16, num_base_trajectories=16),
    ),
    # tiny-1p1d on the testbed hardware: the runtime's emulated GPU time, storage-bound. Its
    # simulator follows the runtime's persistence: an agent's next turn waits until its
    # blocks are durable, and a node writes them in order as they come (no batching).
    "tiny-testbed": Config(
        name="tiny-testbed",
        hardware=CPU_TESTBED,
        model=TINY,
        cluster=ClusterConfig(1, 1, prefill_ep=False, decode_ep=False),
        scheduler=SchedulerConfig(),
        workload=WorkloadConfig(num_agents=16, num_base_trajectories=16),
        sim=SimConfig(next_turn_after_persist=True),
    ),
}

DEFAULT_PRESET = "ds660b-2p4d"


def preset(name: str = DEFAULT_PRESET) -> Config:
    """The cluster preset ``name``; ``ValueError`` listing the known ones otherwise."""
    try:
        return CLUSTER_PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(CLUSTER_PRESETS))
        raise ValueError(f"preset={name!r} is invalid: must be one of {known}") from None
