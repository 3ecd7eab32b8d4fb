//! Targets: one module per GPU architecture, owning everything about the
//! generated code that differs between them.
//!
//! A [`Target`] decides the MoE kernel's tensor-core path, which tile
//! shapes and weight formats that path can compute ([`Target::apk_shape`]),
//! its register budgets, the template partial that holds its device code
//! (`templates/apk/<arch>.cu.tera`, a child of the shared scheduler and
//! signalling in `templates/apk.cu.tera`), the nvcc flags and the SASS
//! instruction families the real-toolchain tier expects in its cubins.
//! Adding an architecture is one more module here and one more partial
//! there; nothing else compares architectures.

mod sm80;
mod sm90a;

pub use sm90a::FP8_SCALE_BLOCK;

use moeforge_dsl::spec::{Arch, AttentionTiles, DType, Tiles};
use moeforge_plan::{ApkPipeline, MmaPath, WeightFormat};

/// A GPU architecture the generators emit code for.
pub trait Target: Sync {
    fn arch(&self) -> Arch;
    fn mma_path(&self) -> MmaPath;
    /// What one math unit of the MoE kernel is ("warpgroups", "warps"), for
    /// the generated source's comments.
    fn unit_name(&self) -> &'static str;
    /// Whether operands arrive through TMA tensor maps (built before launch).
    fn uses_tma(&self) -> bool;
    /// The storage format the MoE kernel reads the experts in.
    fn weight_format(&self, experts: DType, block_scale: Option<[u32; 2]>) -> Result<WeightFormat, TileError>;
    /// The APK's pipeline for these tiles, or which tile field it cannot use.
    fn apk_shape(&self, a: &ApkInput<'_>) -> Result<ApkPipeline, TileError>;
    /// The partial of `templates/apk.cu.tera` with this target's device code: (name, text).
    fn apk_partial(&self) -> (&'static str, &'static str);
    /// SASS instruction families every MoE kernel of this target must contain.
    fn sass_families(&self) -> &'static [&'static str];
    /// The prefill attention kernel's tiles when the spec's `tiles` block has
    /// no `attention` sub-block: FlashAttention-2's 64 query rows (four warps
    /// of mma.sync m16n8k16) × 64 keys per step, which fits heads of up to 128
    /// dims in 36 KB of static shared memory on both targets.
    fn attention_tiles(&self) -> AttentionTiles {
        AttentionTiles { block_q: 64, block_kv: 64 }
    }
    /// nvcc's flags for this target.
    fn nvcc_flags(&self) -> Vec<String> {
        nvcc_flags(self.arch().name())
    }
}

/// The target that generates code for `arch`.
pub fn of(arch: Arch) -> &'static dyn Target {
    match arch {
        Arch::Sm80 => &sm80::Sm80,
        Arch::Sm90a => &sm90a::Sm90a,
    }
}

/// The flags every kernel is compiled with: warnings are errors, and ptxas
/// reports registers, spills and local memory.
pub fn nvcc_flags(arch: &str) -> Vec<String> {
    [
        &format!("-arch={arch}"),
        "--cubin",
        "-O3",
        "-std=c++17",
        "-Werror",
        "all-warnings",
        "-Xptxas",
        "-v,-warn-spills,-warn-lmem-usage",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// A spec value a target cannot generate code for: the field (a dotted path
/// in the tiles block, or in the model block when `model`), and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TileError {
    pub model: bool,
    pub field: String,
    pub message: String,
}

impl TileError {
    pub fn tiles(field: impl Into<String>, message: impl Into<String>) -> TileError {
        TileError { model: false, field: field.into(), message: message.into() }
    }
    pub fn model(field: impl Into<String>, message: impl Into<String>) -> TileError {
        TileError { model: true, field: field.into(), message: message.into() }
    }
}

/// What the APK's pipeline is sized from.
pub struct ApkInput<'a> {
    pub tiles: &'a Tiles,
    /// CTAs per cluster (the cost model's `cluster`).
    pub cluster: u32,
    pub hidden: u32,
    pub inter: u32,
    pub weights: WeightFormat,
    pub smem_per_block: u64,
}

/// The rules every target shares: one reduction depth for the ring, row
/// sizes in 16-byte vectors, one tile height per phase.
fn common_rules(a: &ApkInput<'_>) -> Result<(), TileError> {
    let (pf, dc) = (&a.tiles.prefill, &a.tiles.decode);
    let all = [
        ("prefill.gate_up", &pf.gate_up),
        ("prefill.down", &pf.down),
        ("decode.gate_up", &dc.gate_up),
        ("decode.down", &dc.down),
    ];
    let block_k = pf.gate_up.block_k;
    if let Some((name, t)) = all.iter().find(|(_, t)| t.block_k != block_k) {
        return Err(TileError::tiles(
            format!("{name}.block_k"),
            format!("`{name}.block_k` = {} differs from `prefill.gate_up.block_k` = {block_k}: the APK's stage ring has one depth", t.block_k),
        ));
    }
    for (name, v) in [("hidden", a.hidden), ("moe.expert_ffn", a.inter)] {
        if v % 8 != 0 {
            return Err(TileError::model(
                name,
                format!("the model's {name} = {v} is not a multiple of 8 (16-byte rows for TMA and cp.async)"),
            ));
        }
    }
    if pf.down.block_m != pf.gate_up.block_m {
        return Err(TileError::tiles("prefill.down.block_m", "each phase's gate_up and down tiles must have the same block_m (the Down tile reads the GateUp tile's rows)"));
    }
    if dc.down.block_m != dc.gate_up.block_m {
        return Err(TileError::tiles("decode.down.block_m", "each phase's gate_up and down tiles must have the same block_m (the Down tile reads the GateUp tile's rows)"));
    }
    Ok(())
}

/// Sizes the stage ring: as many of the tile's `block_k / stage_k` × `stages`
/// stages as fit in shared memory, at least two. `stage_bytes` is one
/// stage's operand bytes, `barrier_sets` the mbarriers per stage.
fn ring(a: &ApkInput<'_>, stage_k: u32, stage_bytes: u64, barrier_sets: u64) -> Result<(u32, u32), TileError> {
    // Barriers: the per-stage sets, 2 × (handoff full/empty, broadcast,
    // tile done); 4 decision slots; 1 KiB to align the ring for swizzling.
    let smem_for = |stages: u64| {
        let barriers = 8 * (barrier_sets * stages + 8) + 16 * 4;
        (stages * stage_bytes + barriers).div_ceil(1024) * 1024 + 1024
    };
    let pf = &a.tiles.prefill.gate_up;
    let wanted = u64::from(pf.stages) * u64::from(pf.block_k / stage_k.max(1));
    let stages = (1..=wanted).rev().find(|&n| smem_for(n) <= a.smem_per_block).unwrap_or(0);
    if stages < 2 {
        return Err(TileError::tiles(
            "prefill.gate_up.block_m",
            format!(
                "the APK's ring of {} + {} rows × {stage_k} needs {} bytes of shared memory for two stages; the GPU allows {} ({} too few)",
                pf.block_m.max(a.tiles.decode.gate_up.block_m),
                pf.block_n.max(a.tiles.prefill.down.block_n),
                smem_for(2),
                a.smem_per_block,
                smem_for(2).saturating_sub(a.smem_per_block)
            ),
        ));
    }
    Ok((stages as u32, smem_for(stages) as u32))
}
