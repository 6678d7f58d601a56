"""How a model computes: which of DeepSeek's quantisation simulations run, with which block sizes.

`Numerics` is static (hashable) and travels with the compiled step. With a quantized checkpoint and
`quantize_activations=True` jdeep runs DeepSeek's reference numerics (model-spec.md §6.3-§6.4):
fp8 act_quant before every fp8/fp4 GEMM, fp8 QAT of the window and compressed KV (non-rope dims),
Hadamard + fp4 QAT of the indexer's queries and keys (V4.1, §5: fp8 over all KV dims in blocks of 32,
fp4 compressed KV with e4m3 scales, indexer fp4 without Hadamard). With `False` the weights stay quantized
(decoded on the fly) but activations, KV and indexer run in float: the transformers numerics.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .config import ConfigError, ModelConfig
from .kernels.codecs import E4M3_TRN2_MAX, E4M3FN_MAX
from .kernels.registry import fence_gemm_inputs, native_gemm_rows, pair_kernel_limit, skip_padding_tiles
from .param_spec import FP4_BLOCK, weight_formats

__all__ = ["Numerics"]


@dataclass(frozen=True)
class Numerics:
    quantize_activations: bool = False
    weight_block: tuple[int, int] = (128, 128)  # fp8 weight blocks (from quantization_config)
    act_block: int = 128                         # activation groups before fp8/fp4 GEMMs (= weight K block)
    kv_block: int = 64                           # fp8 QAT groups of the KV's non-rope dims
    fp4_block: int = FP4_BLOCK                   # fp4 weight scales and indexer QAT groups
    fp8_max: float = E4M3FN_MAX                  # activation/KV fp8 range (240 or 224 on trn2)
    trn2_weights: bool = False                   # weight codes were rescaled into trn2's e4m3 at load
    packed_kv: bool = False                      # window/compressed KV kept as uint8 records (kv_record.py)
    v41: bool = False                            # DeepSeek-V4.1's QAT: fp8 over all KV dims, no Hadamard,
    ckv_fp4_block: int = 16                      # compressed KV fp4 with e4m3 scales per 1 x ckv_fp4_block
    pair_kernel_limit: int = 1                   # decode MoE: per-pair kernel while T*k < this x E (the platform's,
                                                 # kernels.pair_kernel_limit; programs built for Neuron on CPU use 1)
    fence_gemm_inputs: bool = False              # act-quantised GEMM inputs written out before the product (the
                                                 # platform's, kernels.fence_gemm_inputs: on CPU)
    skip_padding_tiles: bool = False             # grouped MoE loops over the used tiles only (a routing-dependent
                                                 # trip: kernels.skip_padding_tiles, on CPU; Neuron needs static trips)
    native_gemm_rows: int = 0                    # products of 2..this many rows run the native CPU kernel
                                                 # (kernels.native_gemm_rows: on CPU; 0 on a mesh, which it can't split)

    def portable(self) -> "Numerics":
        """These numerics without jdeep's native CPU products: for programs that run outside this process (export)
        or are checked against Neuron's rules (check-graph), since the kernel is a custom call this process
        registers. Values then differ from the native products' only in the order of fp32 sums."""
        return replace(self, native_gemm_rows=0)

    @classmethod
    def for_config(cls, config: ModelConfig, quantize_activations: bool | None = None,
                   fp8_max: float = E4M3FN_MAX, packed_kv: bool = False, platform: str | None = None
                   ) -> "Numerics":
        """Defaults: DeepSeek's numerics for a quantized checkpoint, plain float otherwise. `platform` (default:
        JAX's backend) is the one the programs are built for; it sets the decode MoE's kernel choice, the GEMM
        input fence, the grouped MoE's trip and the native CPU products."""
        dense_fmt, _, block = weight_formats(config)
        quantized = dense_fmt != "float"
        if quantize_activations is None:
            quantize_activations = quantized
        if fp8_max not in (E4M3FN_MAX, E4M3_TRN2_MAX, 224.0):
            raise ValueError(f"fp8_max must be 448 (e4m3fn), 240 (trn2 e4m3) or 224 (trn2 with margin), got {fp8_max}")
        if packed_kv and not quantize_activations:
            raise ValueError("packed_kv=True stores the KV as fp8 records and needs DeepSeek's KV QAT "
                             "(quantize_activations=True); with float KV it would change the results")
        nx = cls(quantize_activations=bool(quantize_activations), weight_block=block, act_block=block[1],
                 kv_block=32 if config.is_v41 else 64, fp8_max=float(fp8_max),
                 trn2_weights=quantized and fp8_max < E4M3FN_MAX, packed_kv=bool(packed_kv), v41=config.is_v41,
                 pair_kernel_limit=pair_kernel_limit(platform), fence_gemm_inputs=fence_gemm_inputs(platform),
                 skip_padding_tiles=skip_padding_tiles(platform), native_gemm_rows=native_gemm_rows(platform))
        nx._check(config, quantized)
        return nx

    def _check(self, c: ModelConfig, quantized: bool) -> None:
        """The block sizes must tile the tensors they quantize (DeepSeek's kernels assert the same)."""
        if not self.quantize_activations:
            return
        need = {"index_head_dim (indexer fp4 QAT)": (c.index_head_dim, self.fp4_block)}
        if self.v41:
            need.update({"head_dim (window KV fp8 QAT)": (c.head_dim, self.kv_block),
                         "head_dim (compressed KV fp4 QAT)": (c.head_dim, self.ckv_fp4_block)})
        else:
            need["head_dim - qk_rope_head_dim (KV QAT)"] = (c.head_dim - c.rope_head_dim, self.kv_block)
        if quantized:
            need.update({"hidden_size": (c.dim, self.act_block), "q_lora_rank": (c.q_lora_rank, self.act_block),
                         "moe_intermediate_size": (c.moe_inter_dim, self.act_block),
                         "o_groups * o_lora_rank": (c.o_groups * c.o_lora_rank, self.act_block)})
        for what, (n, b) in need.items():
            if n % b:
                raise ConfigError(f"{what} = {n} is not a multiple of the quantisation block {b}: "
                                  "DeepSeek's numerics (quantize_activations=True) cannot run on this config")
        if not self.v41 and c.index_head_dim & (c.index_head_dim - 1):
            raise ConfigError(f"index_head_dim = {c.index_head_dim} must be a power of two for the indexer's Hadamard rotation")
