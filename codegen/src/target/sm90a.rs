//! sm_90a (H100, H800, H200): wgmma m64nNk16 fed by TMA with 128-byte
//! swizzling, a warp-specialized producer warpgroup, the activation tile
//! multicast across the CTA cluster, `setmaxnreg`, and fp8 e4m3 experts
//! dequantized to bf16 in shared memory (W8A16).

use super::{common_rules, ring, ApkInput, Target, TileError};
use moeforge_dsl::spec::{Arch, DType};
use moeforge_plan::{ApkPipeline, MmaPath, WeightFormat};

pub struct Sm90a;

/// Reduction depth of one wgmma pipeline stage: one 128-byte swizzled bf16 row.
const STAGE_K: u32 = 64;
/// fp8 experts' block-scale size (DeepSeek-V3's `weight_scale_inv` blocks).
pub const FP8_SCALE_BLOCK: u32 = 128;
/// `setmaxnreg` budgets: the producer warpgroup (which also runs the
/// scheduler, hence more than a bare TMA warp) gives registers to the two
/// math warpgroups. The launch holds 384 × 168 registers (`__launch_bounds__`
/// with one CTA per SM), and 128·72 + 256·216 = 384·168 exactly, so the
/// increase never waits for registers.
const PRODUCER_REGS: u32 = 72;
const CONSUMER_REGS: u32 = 216;

impl Target for Sm90a {
    fn arch(&self) -> Arch {
        Arch::Sm90a
    }
    fn mma_path(&self) -> MmaPath {
        MmaPath::Wgmma
    }
    fn unit_name(&self) -> &'static str {
        "warpgroups"
    }
    fn uses_tma(&self) -> bool {
        true
    }

    fn weight_format(&self, experts: DType, block_scale: Option<[u32; 2]>) -> Result<WeightFormat, TileError> {
        match experts {
            DType::Bf16 => Ok(WeightFormat::Bf16),
            DType::Fp8E4m3 if block_scale == Some([FP8_SCALE_BLOCK; 2]) => Ok(WeightFormat::Fp8E4m3),
            DType::Fp8E4m3 => Err(TileError::model(
                "dtype.block_scale",
                format!("fp8 experts need {FP8_SCALE_BLOCK}×{FP8_SCALE_BLOCK} block scales, this model declares {block_scale:?}"),
            )),
            other => Err(TileError::model("dtype.experts", format!("{} experts are not generated", other.name()))),
        }
    }

    fn apk_shape(&self, a: &ApkInput<'_>) -> Result<ApkPipeline, TileError> {
        common_rules(a)?;
        let (pf, dc) = (&a.tiles.prefill, &a.tiles.decode);
        let (block_k, cluster) = (pf.gate_up.block_k, a.cluster);
        let fp8 = a.weights == WeightFormat::Fp8E4m3;
        if block_k % STAGE_K != 0 {
            return Err(TileError::tiles("prefill.gate_up.block_k", format!(
                "block_k = {block_k}: the wgmma path stages 128-byte swizzled rows of {STAGE_K} bf16, block_k must be a multiple of {STAGE_K}"
            )));
        }
        if fp8 && !a.hidden.is_multiple_of(16) {
            return Err(TileError::model(
                "hidden",
                format!("hidden = {}: fp8 weight rows must be a multiple of 16 bytes for TMA", a.hidden),
            ));
        }
        if fp8 && !a.inter.is_multiple_of(FP8_SCALE_BLOCK) {
            return Err(TileError::model("moe.expert_ffn", format!("expert_ffn = {}: fp8 gate and up weights are one [2·expert_ffn] matrix whose {FP8_SCALE_BLOCK}-row scale blocks must not straddle them", a.inter)));
        }
        let (n_gu, n_d) = (pf.gate_up.block_n, pf.down.block_n);
        if fp8 && (n_gu / 2 == 0 || !FP8_SCALE_BLOCK.is_multiple_of(n_gu / 2) || !FP8_SCALE_BLOCK.is_multiple_of(n_d)) {
            return Err(TileError::tiles("prefill.gate_up.block_n", format!("block_n = {n_gu} (gate_up) / {n_d} (down): with fp8 weights a tile's columns (half of gate_up's) must lie in one {FP8_SCALE_BLOCK}-row scale block")));
        }
        for (what, m) in [("prefill", pf.gate_up.block_m), ("decode", dc.gate_up.block_m)] {
            if m != 64 && m != 128 {
                return Err(TileError::tiles(
                    format!("{what}.gate_up.block_m"),
                    format!(
                        "{what} block_m = {m}: the wgmma path runs one or two 64-row warpgroups, block_m = 64 or 128"
                    ),
                ));
            }
            if (m / cluster) % 8 != 0 {
                return Err(TileError::tiles("prefill.gate_up.cluster", format!("{what} block_m = {m} split over a {cluster}-CTA cluster is not a multiple of 8 rows per multicast slice")));
            }
        }
        if n_gu % 16 != 0 || n_gu > 256 || n_d % 8 != 0 || n_d > 256 {
            return Err(TileError::tiles("prefill.gate_up.block_n", format!("block_n = {n_gu} (gate_up) / {n_d} (down): wgmma needs gate_up a multiple of 16 and down of 8, both at most 256")));
        }
        let mt_max = pf.gate_up.block_m.max(dc.gate_up.block_m);
        let n_max = n_gu.max(n_d);
        // Per stage: the activation and (bf16) weight tiles, plus the raw fp8
        // weight tile the transform warps dequantize from.
        let stage_bytes = u64::from((mt_max + n_max) * STAGE_K) * 2 + if fp8 { u64::from(n_max * STAGE_K) } else { 0 };
        let (stages, smem_bytes) = ring(a, STAGE_K, stage_bytes, if fp8 { 3 } else { 2 })?;
        let units = mt_max / 64;
        // The register split is sized for one producer and two math warpgroups.
        let (producer_regs, consumer_regs) = if units == 2 { (PRODUCER_REGS, CONSUMER_REGS) } else { (0, 0) };
        Ok(ApkPipeline {
            block_k: STAGE_K,
            stages,
            units,
            unit_threads: 128,
            threads: 128 + units * 128,
            producer_regs,
            consumer_regs,
            smem_bytes,
        })
    }

    fn apk_partial(&self) -> (&'static str, &'static str) {
        ("apk/sm90a.cu.tera", include_str!("../../templates/apk/sm90a.cu.tera"))
    }

    fn sass_families(&self) -> &'static [&'static str] {
        &["HGMMA", "UTMALDG", "SYNCS"]
    }
}
