"""Runtime-only options (what the config does not cover): system, KV root, transport, faults."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config import Config
from dualpath.config.systems import SystemSpec, shell_system, system_spec
from dualpath.kv.store import BlockLayout
from dualpath.runtime.gputime import GPU_TIMES
from dualpath.tokens import VocabSpec

TRANSPORTS = ("shm", "tcp", "mooncake")
RUNTIMES = ("local", "ray")
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")


# the reuse designs our runtime carries out (docs/peers.md): a DRAM tier in each storage
# worker; decode-side holds pinned in the DEs' pools (scheduler.holds)
RUNTIME_REUSES = ("dram-tier", "d2p")


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """Fault injection for tests: engine ``crash_engine`` exits abruptly when it receives its
    ``crash_at_message``-th work message (first incarnation only). -1 = no fault."""

    crash_engine: int = -1
    crash_at_message: int = 1
    # storage workers: the first ``fail_writes`` block-file writes fail with ENOSPC halfway
    # through the payload (a full disk); -1 = every write fails
    fail_writes: int = 0
    # engine ``crash_engine`` at its ``crash_at_message``-th work message: "exit" (os._exit)
    # or "stop" (SIGSTOP itself: a stalled engine, found by its missing heartbeat)
    crash_mode: str = "exit"
    # node ``crash_storage``'s storage worker exits abruptly at its first read (first
    # incarnation only); -1 = no fault
    crash_storage: int = -1
    # every node's storage worker exits abruptly when it takes its first write (first
    # incarnation only): all of them lost at once, the writes they took never acknowledged
    crash_storage_writes: bool = False


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    """``system``: one of ``SYSTEM_NAMES`` (``dualpath.config.systems``); ``oracle`` runs dualpath
    with KV traffic unpaced (storage reads, buffer loads and PD transfers take no emulated NIC
    time). ``kv_root``: the KV store root
    (on a cluster, a shared file-system mount). ``tenant``: salt of the KV namespace, so one
    tenant never reads another's blocks. ``buffer_slots``: Full-Block slots per node
    buffer (0 = from ``hardware.pe_buffer_bytes`` / ``de_buffer_bytes``). ``hbm_tokens``: KV
    capacity of each engine's paged HBM, in tokens of all layers (pages of one Layer Block);
    ``pe_hbm_tokens`` overrides it for PEs.
    ``batching``: False runs one request per PE forward pass and per DE decode batch (the
    one-at-a-time baseline of the benchmark). ``transfer_window``: Layer-Block transfers one
    engine thread keeps outstanding (1 = each waited for before the next is issued).
    ``runtime``: ``local`` (processes on this host) or ``ray`` (Ray actors placed per node,
    ``ray_address`` the cluster's GCS address, "" = a local Ray instance); Ray needs a
    transport that crosses nodes (tcp or mooncake).
    ``model_dir``: a local Hugging Face checkpoint (Llama / Qwen2 / Qwen3) every engine runs
    (memory-mapped); "" = the preset's built-in tiny model from ``weight_seed``. ``device``:
    ``cpu`` or ``cuda`` (engine i on ``cuda:i % device_count``; ``cuda:N`` pins every engine
    to GPU N); ``dtype``: the engines' compute and KV dtype. ``threads``: torch CPU threads
    per engine process (0 = the host's cores shared evenly by the engines, at least 1: each
    emulated GPU gets its share of the host and no engine's spinning threads steal another's
    core). ``gpu_time``: ``host`` (a pass takes what the host's compute takes: today's
    behaviour; on CUDA the real GPU) or ``emulated`` (each PE forward pass and DE decode
    step, computed for real, completes no earlier than the cost model's time for it on
    ``config.hardware``: ``runtime.gputime``, docs/runtime.md). ``vocab``: what the engines build the grammar library's tokenizer from (set by the
    server; without it a request with a grammar is refused)."""

    system: str = "dualpath"
    kv_root: str = "./.dualpath/kv"
    transport: str = "shm"
    buffer_slots: int = 0
    hbm_tokens: int = 65536
    pe_hbm_tokens: int = 0  # the PEs' pool when it differs (0 = hbm_tokens)
    batching: bool = True
    transfer_window: int = 16
    weight_seed: int = 0
    tenant: str = ""  # per-tenant salt of the KV namespace ("" = the one default tenant)
    direct_io: bool = False
    ready_timeout_s: float = 120.0
    request_timeout_s: float = 300.0
    liveness_timeout_s: float = 5.0  # a child silent this long is declared dead (killed)
    faults: FaultPlan = FaultPlan()
    runtime: str = "local"
    ray_address: str = ""
    model_dir: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 0
    gpu_time: str = "host"
    vocab: VocabSpec | None = None  # the tokenizer's vocabulary: grammar-constrained requests

    def __post_init__(self) -> None:
        # ValueError naming the allowed systems
        shell_system(self.system, "our runtime", RUNTIME_REUSES)
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"transport={self.transport!r} is invalid: must be one of {', '.join(TRANSPORTS)}"
            )
        if self.runtime not in RUNTIMES:
            raise ValueError(
                f"runtime={self.runtime!r} is invalid: must be one of {', '.join(RUNTIMES)}"
            )
        if self.runtime == "ray" and self.transport == "shm":
            raise ValueError(
                "transport='shm' is invalid with runtime='ray': shared memory cannot cross "
                "nodes (use tcp or mooncake)"
            )
        if self.device.split(":")[0] not in DEVICES or (
            ":" in self.device and not self.device.split(":", 1)[1].isdigit()
        ):
            raise ValueError(f"device={self.device!r} is invalid: must be cpu, cuda or cuda:N")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid: must be one of {', '.join(DTYPES)}")
        if not self.model_dir and (self.device != "cpu" or self.dtype != "float32"):
            raise ValueError(
                f"device={self.device!r} / dtype={self.dtype!r}: the built-in tiny model runs on "
                "cpu in float32 only (give model_dir for a checkpoint)"
            )
        if self.gpu_time not in GPU_TIMES:
            raise ValueError(
                f"gpu_time={self.gpu_time!r} is invalid: must be one of {', '.join(GPU_TIMES)}"
            )
        if self.threads < 0:
            raise ValueError(f"threads={self.threads} is invalid: must be >= 0 (0 = auto)")
        if self.hbm_tokens < 1:
            raise ValueError(f"hbm_tokens={self.hbm_tokens} is invalid: must be >= 1")
        if self.pe_hbm_tokens < 0:
            raise ValueError(f"pe_hbm_tokens={self.pe_hbm_tokens} is invalid: must be >= 0")
        if self.transfer_window < 1:
            raise ValueError(f"transfer_window={self.transfer_window} is invalid: must be >= 1")
        if self.buffer_slots < 0:
            raise ValueError(f"buffer_slots={self.buffer_slots} is invalid: must be >= 0")

    def hbm_pages(self, num_layers: int, block_tokens: int, pe: bool = False) -> int:
        """Pages (one Layer Block each) of an engine's HBM pool (a PE's with ``pe``)."""
        tokens = self.pe_hbm_tokens if pe and self.pe_hbm_tokens else self.hbm_tokens
        return max(1, tokens // block_tokens) * num_layers

    def engine_threads(self, num_engines: int, cpu_count: int) -> int:
        """Torch CPU threads of each of ``num_engines`` engine processes on ``cpu_count``
        cores (see ``threads``)."""
        return self.threads or max(1, cpu_count // max(1, num_engines))

    def engine_device(self, engine: int, device_count: int) -> str:
        """Engine ``engine``'s torch device: ``cuda`` spreads engines over the GPUs."""
        if self.device == "cuda":
            return f"cuda:{engine % max(1, device_count)}"
        return self.device

    @property
    def spec(self) -> SystemSpec:
        return system_spec(self.system)

    @property
    def paced_kv(self) -> bool:
        return not self.spec.oracle


def buffer_slots(config: Config, options: RuntimeOptions, node_is_pe: bool) -> int:
    """Full Blocks a node buffer holds: ``options.buffer_slots``, else the PE or DE buffer's
    bytes (``hardware``) over one Full Block's."""
    if options.buffer_slots:
        return options.buffer_slots
    m = config.model
    full = BlockLayout(m.num_layers, config.scheduler.block_tokens, m.kv_bytes_per_token_per_layer)
    size = config.hardware.pe_buffer_bytes if node_is_pe else config.hardware.de_buffer_bytes
    return max(1, int(size // full.full_block_bytes))


def startup_warning(options: RuntimeOptions) -> str | None:
    """The one line a run prints at start-up about its transport's exposure, if any."""
    if options.transport != "mooncake":
        return None
    from dualpath.kv.transport.mooncake import BIND_WARNING

    return BIND_WARNING
