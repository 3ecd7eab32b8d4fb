//! sm_80 (A100) and the portable path: a producer warp streaming tiles with
//! cp.async, math warps reading them with ldmatrix into mma.sync m16n8k16,
//! no CTA clusters, bf16 experts only.

use super::{common_rules, ring, ApkInput, Target, TileError};
use moeforge_dsl::spec::{Arch, DType};
use moeforge_plan::{ApkPipeline, MmaPath, WeightFormat};

pub struct Sm80;

/// mma.sync math warps per CTA.
const WARPS: u32 = 4;

impl Target for Sm80 {
    fn arch(&self) -> Arch {
        Arch::Sm80
    }
    fn mma_path(&self) -> MmaPath {
        MmaPath::MmaSync
    }
    fn unit_name(&self) -> &'static str {
        "warps"
    }
    fn uses_tma(&self) -> bool {
        false
    }

    fn weight_format(&self, experts: DType, _block_scale: Option<[u32; 2]>) -> Result<WeightFormat, TileError> {
        match experts {
            DType::Bf16 => Ok(WeightFormat::Bf16),
            other => Err(TileError::model(
                "dtype.experts",
                format!("{} experts need sm_90a (the portable path computes bf16 experts)", other.name()),
            )),
        }
    }

    fn apk_shape(&self, a: &ApkInput<'_>) -> Result<ApkPipeline, TileError> {
        common_rules(a)?;
        let (pf, dc) = (&a.tiles.prefill, &a.tiles.decode);
        let block_k = pf.gate_up.block_k;
        if block_k % 16 != 0 {
            return Err(TileError::tiles(
                "prefill.gate_up.block_k",
                format!("block_k = {block_k} is not a multiple of 16 (mma.sync k16)"),
            ));
        }
        let (mt_p, mt_d) = (pf.gate_up.block_m, dc.gate_up.block_m);
        if mt_p % 16 != 0 || mt_d % 16 != 0 {
            return Err(TileError::tiles(
                "prefill.gate_up.block_m",
                format!("block_m = {mt_p}/{mt_d}: mma.sync needs multiples of 16"),
            ));
        }
        let (n_gu, n_d) = (pf.gate_up.block_n, pf.down.block_n);
        if n_gu % (16 * WARPS) != 0 || n_d % (8 * WARPS) != 0 {
            return Err(TileError::tiles("prefill.gate_up.block_n", format!("block_n = {n_gu} (gate_up) / {n_d} (down): {WARPS} math warps need gate_up a multiple of {} and down of {}", 16 * WARPS, 8 * WARPS)));
        }
        // Rows padded by 8 elements: conflict-free ldmatrix without swizzling.
        let row = block_k + 8;
        let stage_bytes = u64::from((mt_p.max(mt_d) + n_gu.max(n_d)) * row) * 2;
        let (stages, smem_bytes) = ring(a, block_k, stage_bytes, 2)?;
        Ok(ApkPipeline {
            block_k,
            stages,
            units: WARPS,
            unit_threads: 32,
            threads: 32 + WARPS * 32,
            producer_regs: 0,
            consumer_regs: 0,
            smem_bytes,
        })
    }

    fn apk_partial(&self) -> (&'static str, &'static str) {
        ("apk/sm80.cu.tera", include_str!("../../templates/apk/sm80.cu.tera"))
    }

    fn sass_families(&self) -> &'static [&'static str] {
        &["HMMA", "LDSM", "LDGSTS"]
    }
}
