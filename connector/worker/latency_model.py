"""The sim backend's latency model: one GPU and model, every parameter in one place.

Modelled: Llama-3.1-8B-Instruct (32 layers, 8 KV heads x 128, bf16) on one H100 SXM 80 GB.
The parameters are derived from the H100's published peak figures (989 TFLOPS dense bf16,
3.35 TB/s HBM3) at the efficiencies serving engines measure on it, not fitted to one trace:
- prefill is compute-bound: 2 FLOPs x 8.0 B parameters per token at ~40 % MFU gives about
  40 us per token (25K tokens/s); attention adds 4 x layers x hidden = 0.52 MFLOP per (new
  token, context token) pair at the same efficiency;
- a decode step is memory-bound: reading 16 GB of weights at ~70 % of 3.35 TB/s is 6.8 ms,
  plus each sequence's KV (128 KiB per token) read once per step;
- a fixed per-step cost for scheduling and kernel launches;
- KV moving between a prefill and a decode instance (disaggregation) crosses one RDMA NIC
  per GPU, 200 Gb/s (25 GB/s, ConnectX-7 / HDR class), after a fixed per-transfer cost of
  100 us for the allocation and commit round trips of MemServe's three-step transfer;
- KV moving between host DRAM and the GPU (the hierarchical cache's host tier) crosses the
  H100's PCIe Gen5 x16 host link: 64 GB/s a direction raw, about 50 GB/s for pinned-memory
  copies as measured (nvbandwidth's host-to-device copy), after a fixed 50 us per load:
  SGLang copies the KV back one layer at a time (32 copy kernels of a few us, then a wait).
  A load from the host tier is on the critical path of the request that needs it (added to
  the step that prefills it); a swap-out to the host runs on its own stream (SGLang's
  write-through), so it is counted, not waited for.
The model is a model: /get_server_info and every benchmark print these parameters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mempool import KVBlockSpec


@dataclass(frozen=True, slots=True)
class LatencyModel:
    gpu: str = "H100-SXM-80GB"
    model: str = "Llama-3.1-8B-Instruct"
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    weights_bytes: float = 16.06e9
    hbm_bytes: float = 80e9
    step_overhead_s: float = 0.0015
    prefill_per_token_s: float = 4.0e-5
    prefill_per_token_pair_s: float = 1.3e-9
    decode_weights_s: float = 6.8e-3
    decode_per_context_token_s: float = 5.6e-8
    interconnect: str = "RDMA, one 200 Gb/s NIC per GPU"
    interconnect_bytes_per_s: float = 25e9
    transfer_latency_s: float = 1.0e-4
    host_link: str = "PCIe Gen5 x16, GPU <-> host DRAM"
    host_link_bytes_per_s: float = 50e9
    host_copy_latency_s: float = 5.0e-5
    # Loading a LoRA adapter's weights (from local NVMe into host memory, then to the GPU's
    # adapter pool): a fixed cost plus its bytes at NVMe read speed; the PCIe copy (50 GB/s)
    # is small beside it. A rank-16 adapter on every linear layer of Llama-3.1-8B: 84 MB.
    lora_storage: str = "local NVMe, 2 GB/s read"
    lora_load_bytes_per_s: float = 2e9
    lora_load_latency_s: float = 0.01

    def kv_spec(self, page_size: int) -> KVBlockSpec:
        return KVBlockSpec(self.layers, self.kv_heads, self.head_dim, self.dtype, page_size)

    def stand_in_spec(self, page_size: int) -> KVBlockSpec:
        """A small page that stands in for `kv_spec`'s between disaggregated sim instances.

        Same page size and page count, so caching, allocation and the transfer protocol run
        as they would, but a token takes 16 bytes (one layer, one head of 4 bf16 values, K
        and V: 256 bytes a 16-token page) instead of 128 KiB: moving real pages over
        loopback TCP would cost a small test machine seconds per long prompt. The bytes
        moved are a stand-in; `transfer_s` models the time the real ones would take.
        """
        return KVBlockSpec(1, 1, 4, "bfloat16", page_size)

    def transfer_s(self, pages: int, page_size: int) -> float:
        """Moving `pages` pages of the modelled KV over the interconnect, in one transfer."""
        nbytes = pages * self.kv_spec(page_size).page_bytes
        return self.transfer_latency_s + nbytes / self.interconnect_bytes_per_s

    def host_copy_s(self, pages: int, page_size: int) -> float:
        """Copying `pages` pages of the modelled KV between host DRAM and the GPU, in one go."""
        if pages <= 0:
            return 0.0
        nbytes = pages * self.kv_spec(page_size).page_bytes
        return self.host_copy_latency_s + nbytes / self.host_link_bytes_per_s

    def lora_load_s(self, nbytes: float) -> float:
        """Loading one LoRA adapter of `nbytes` bytes before the step that uses it."""
        return self.lora_load_latency_s + nbytes / self.lora_load_bytes_per_s

    def kv_capacity_tokens(self, page_size: int, memory_fraction: float = 0.9) -> int:
        """Tokens of KV an instance holds: HBM x fraction minus weights, as SGLang sizes it."""
        free = self.hbm_bytes * memory_fraction - self.weights_bytes
        return int(free // self.kv_spec(page_size).bytes_per_token)

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Computing `new_tokens` after `cached_tokens` of reused context."""
        pairs = new_tokens * (cached_tokens + new_tokens / 2)
        return new_tokens * self.prefill_per_token_s + pairs * self.prefill_per_token_pair_s

    def decode_s(self, batch: int, context_tokens: int) -> float:
        """One decode step for `batch` sequences holding `context_tokens` in all."""
        if batch == 0:
            return 0.0
        return self.decode_weights_s + context_tokens * self.decode_per_context_token_s

    def step_s(
        self,
        prefills: list[tuple[int, int]],
        decode_batch: int,
        decode_ctx: int,
        load_s: float = 0.0,
    ) -> float:
        """One engine step: the prefills (new, cached), one decode token per running seq,
        and `load_s` of host-tier KV the prefills wait for."""
        work = (
            sum(self.prefill_s(n, c) for n, c in prefills)
            + self.decode_s(decode_batch, decode_ctx)
            + load_s
        )
        return self.step_overhead_s + work if work else 0.0

    def describe(self) -> dict[str, Any]:
        return asdict(self)
