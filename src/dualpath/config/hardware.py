"""Per-node hardware: GPUs, NICs, DRAM, HBM, FLOP/s, buffers, and named calibration constants."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config.checks import fraction, non_negative, positive, require


@dataclass(frozen=True, slots=True)
class HardwareConfig:
    """One node of the cluster (design §2, §10, §13.9). Bandwidths are per direction.

    Calibration constants (achievable fractions of peak) are named here, never fitted to the
    paper's speedups; their sources are in docs/calibration.md.
    """

    name: str = "hopper"
    gpus_per_node: int = 8
    cnic_bytes_per_s: float = 50e9  # one 400 Gb/s compute NIC per GPU (B)
    snic_per_node: int = 1  # storage NICs per node (s)
    snic_bytes_per_s: float = 50e9  # bandwidth of one storage NIC
    dram_bytes_per_s: float = 500e9  # host DRAM, half duplex (M)
    hbm_bytes: float = 80e9
    hbm_bytes_per_s: float = 3.35e12
    gpu_bf16_flops: float = 989e12  # dense BF16 peak
    gpu_fp8_flops: float = 1979e12  # dense FP8 peak
    pe_buffer_bytes: float = 80e9  # PE buffer per prefill node (DRAM slice)
    de_buffer_bytes: float = 80e9  # DE buffer per decode node
    storage_read_bytes_per_s: float = 0.0  # aggregate storage limit; 0 = never a bottleneck
    activation_reserve_bytes: float = 6e9  # HBM kept for activations, per GPU
    # --- calibration constants (see docs/calibration.md) ---
    linear_mfu: float = 0.45  # achieved / peak FLOP/s of prefill GEMMs (dense + experts)
    attention_mfu: float = 0.60  # achieved / peak FLOP/s of prefill attention kernels
    hbm_efficiency: float = 0.80  # achieved / peak HBM bandwidth reading weights in decode steps
    kv_read_efficiency: float = 0.80  # achieved / peak HBM bandwidth of decode attention's KV reads
    decode_step_overhead_s: float = 0.004  # fixed per decode step (launch, sampling, sync)
    # --- latency terms (see docs/calibration.md, "Latency terms") ---
    ep_dispatch_latency_s: float = 155e-6  # DeepEP low-latency dispatch per MoE layer, EP32, H800
    ep_combine_latency_s: float = 273e-6  # DeepEP low-latency combine per MoE layer, EP32, H800
    ep_overlap_share: float = 0.5  # share of dispatch + combine hidden by two-micro-batch overlap
    prefill_pass_overhead_s: float = 0.004  # fixed per prefill forward pass (as a decode step)
    prefill_layer_overhead_s: float = 40e-6  # fixed per layer per prefill pass (kernel launches)
    hbm_dma_interference: float = 1.0  # decode HBM bytes displaced per byte DMA'd in/out of HBM

    def __post_init__(self) -> None:
        require(self.gpus_per_node >= 1, "hardware.gpus_per_node", self.gpus_per_node, ">= 1")
        require(self.snic_per_node >= 1, "hardware.snic_per_node", self.snic_per_node, ">= 1")
        for name in (
            "cnic_bytes_per_s",
            "snic_bytes_per_s",
            "dram_bytes_per_s",
            "hbm_bytes",
            "hbm_bytes_per_s",
            "gpu_bf16_flops",
            "gpu_fp8_flops",
            "pe_buffer_bytes",
            "de_buffer_bytes",
        ):
            positive(f"hardware.{name}", getattr(self, name))
        non_negative("hardware.storage_read_bytes_per_s", self.storage_read_bytes_per_s)
        non_negative("hardware.activation_reserve_bytes", self.activation_reserve_bytes)
        for name in (
            "decode_step_overhead_s",
            "ep_dispatch_latency_s",
            "ep_combine_latency_s",
            "prefill_pass_overhead_s",
            "prefill_layer_overhead_s",
            "hbm_dma_interference",
        ):
            non_negative(f"hardware.{name}", getattr(self, name))
        require(
            0.0 <= self.ep_overlap_share <= 1.0,
            "hardware.ep_overlap_share",
            self.ep_overlap_share,
            "in [0, 1]",
        )
        for name in ("linear_mfu", "attention_mfu", "hbm_efficiency", "kv_read_efficiency"):
            fraction(f"hardware.{name}", getattr(self, name))
        require(
            self.activation_reserve_bytes < self.hbm_bytes,
            "hardware.activation_reserve_bytes",
            self.activation_reserve_bytes,
            f"< hardware.hbm_bytes ({self.hbm_bytes:g})",
        )

    @property
    def snic_total_bytes_per_s(self) -> float:
        """Storage bandwidth of one node, s·B (all its storage NICs)."""
        return self.snic_per_node * self.snic_bytes_per_s

    @property
    def s_ratio(self) -> float:
        """s in design §5: a node's storage bandwidth in units of one CNIC."""
        return self.snic_total_bytes_per_s / self.cnic_bytes_per_s
