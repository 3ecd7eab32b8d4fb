//! CUDA source from tera templates.
//!
//! The templates (`codegen/templates/*.cu.tera`, embedded at build time)
//! only print the kernel's parameter struct; every decision is made in the
//! kernels pass and the target. The APK is the shared scheduler and
//! signalling (`apk.cu.tera`) extended by the target's partial
//! (`apk/<arch>.cu.tera`), which [`crate::target::Target::apk_partial`] names.

use moeforge_plan::validate::ValidPlan;
use moeforge_plan::{KernelInstance, KernelParams};

const ROUTER: &str = include_str!("../../templates/router.cu.tera");
const PERMUTE: &str = include_str!("../../templates/permute.cu.tera");
const APK: &str = include_str!("../../templates/apk.cu.tera");
const PTX: &str = include_str!("../../templates/ptx.cu.tera");
const LAYER: &str = include_str!("../../templates/layer.cu.tera");
const EMU_LAUNCH: &str = include_str!("../../templates/emu_launch.cu.tera");
const ZEPP: &str = include_str!("../../templates/zepp_route.cu.tera");

/// An entry of the emulated device's launch table: its symbol and its
/// parameters' C types, in order.
#[derive(serde::Serialize)]
struct EmuEntry<'a> {
    symbol: &'a str,
    types: Vec<&'a str>,
}

#[derive(Debug, thiserror::Error)]
#[error("template `{template}` failed: {message}")]
pub struct TemplateError {
    pub template: String,
    pub message: String,
}

/// A float as a C++ `float` literal that round-trips (`2.5f`, `1.0f`).
fn float_literal(v: f64) -> String {
    let s = format!("{:?}", v as f32);
    let s = if s.contains(['.', 'e', 'E']) { s } else { format!("{s}.0") };
    format!("{s}f")
}

/// The inline-asm operand text of one `wgmma.mma_async` m64nNk16 shape:
/// N/2 fp32 accumulators per thread, then the two descriptors and the
/// scale-d flag.
#[derive(serde::Serialize)]
struct WgmmaOperands {
    n: u32,
    regs: u32,
    /// `%0, %1, …` for the accumulators.
    list: String,
    /// `"+f"(d[0]), …`.
    outputs: String,
    desc_a: u32,
    desc_b: u32,
    scale_d: u32,
}

fn wgmma_operands(n: u32) -> WgmmaOperands {
    let regs = n / 2;
    WgmmaOperands {
        n,
        regs,
        list: (0..regs).map(|i| format!("%{i}")).collect::<Vec<_>>().join(", "),
        outputs: (0..regs).map(|i| format!("\"+f\"(d[{i}])")).collect::<Vec<_>>().join(", "),
        desc_a: regs,
        desc_b: regs + 1,
        scale_d: regs + 2,
    }
}

/// Renders one kernel's source.
pub fn render(plan: &ValidPlan, k: &KernelInstance) -> Result<String, TemplateError> {
    let mut ctx = tera::Context::new();
    ctx.insert("version", env!("CARGO_PKG_VERSION"));
    ctx.insert("deploy", &plan.plan().deploy);
    ctx.insert("purpose", &k.purpose);
    let emu: Vec<EmuEntry<'_>> = k
        .entries
        .iter()
        .map(|e| EmuEntry {
            symbol: &e.symbol,
            types: e.params.iter().map(|p| p.rsplit_once(' ').map_or(p.as_str(), |(t, _)| t)).collect(),
        })
        .collect();
    ctx.insert("emu_entries", &emu);
    // (template to render, every template it needs)
    let (name, templates): (&str, Vec<(&str, &str)>) = match &k.params {
        KernelParams::Router(p) => {
            ctx.insert("p", p);
            ctx.insert("sigmoid", &(p.scoring == moeforge_plan::Scoring::Sigmoid));
            ctx.insert("scaling", &float_literal(p.scaling));
            ("router.cu", vec![("router.cu", ROUTER), ("emu_launch.cu", EMU_LAUNCH)])
        }
        KernelParams::Permute(p) => {
            ctx.insert("p", p);
            ("permute.cu", vec![("permute.cu", PERMUTE), ("emu_launch.cu", EMU_LAUNCH)])
        }
        KernelParams::Zepp(p) => {
            ctx.insert("p", p);
            ctx.insert("zepp", &(p.policy == moeforge_dsl::spec::PlacementPolicy::Zepp));
            // The double the plan holds, digit for digit (the host routing's bound).
            ctx.insert("slack", &format!("{:?}", p.slack));
            ("zepp_route.cu", vec![("zepp_route.cu", ZEPP), ("emu_launch.cu", EMU_LAUNCH)])
        }
        KernelParams::Layer(p) => {
            ctx.insert("p", p);
            ctx.insert("eps", &float_literal(p.rms_eps));
            ctx.insert("gqa", &p.gqa);
            if let Some(g) = &p.gqa {
                ctx.insert("rope_scale", &float_literal(g.rope_scale));
                let freqs: Vec<String> = g.inv_freq.iter().map(|f| format!("{f:?}")).collect();
                ctx.insert("inv_freq", &freqs.join(", "));
                ctx.insert("qk_norm", &(g.qk_norm != moeforge_plan::QkNormKind::None));
                ctx.insert("qk_all_heads", &(g.qk_norm == moeforge_plan::QkNormKind::AllHeads));
            }
            ctx.insert("mla", &p.mla);
            if let Some(a) = &p.mla {
                ctx.insert("rope_scale", &float_literal(a.rope_scale));
                ctx.insert("softmax_scale", &float_literal(a.softmax_scale));
                let freqs: Vec<String> = a.inv_freq.iter().map(|f| format!("{f:?}")).collect();
                ctx.insert("inv_freq", &freqs.join(", "));
            }
            // The PTX layer's portable half (mma.sync) for the prefill attention.
            ctx.insert("wgmma_path", &false);
            ctx.insert("wgmma", &Vec::<WgmmaOperands>::new());
            ctx.insert("fp8", &false);
            ("layer.cu", vec![("layer.cu", LAYER), ("ptx.cu.tera", PTX), ("emu_launch.cu", EMU_LAUNCH)])
        }
        KernelParams::Apk(p) => {
            let target = crate::target::of(k.arch);
            ctx.insert("p", p);
            ctx.insert("x_star", &float_literal(p.x_star));
            ctx.insert("fp8", &(p.weights == moeforge_plan::WeightFormat::Fp8E4m3));
            ctx.insert("dense", &(p.form == moeforge_plan::ApkForm::Dense));
            ctx.insert("swiglu_oai", &(p.activation == moeforge_dsl::spec::Activation::SwigluOai));
            ctx.insert("swiglu_alpha", &float_literal(moeforge_dsl::hf::SWIGLU_OAI_ALPHA));
            ctx.insert("swiglu_limit", &float_literal(moeforge_dsl::hf::SWIGLU_OAI_LIMIT));
            ctx.insert("entry", &k.entries.first().map_or("moe_apk", |e| e.symbol.as_str()));
            ctx.insert("unit_name", target.unit_name());
            ctx.insert("uses_tma", if target.uses_tma() { "true" } else { "false" });
            let mut ns = vec![p.n_t_gate_up, p.n_t_down];
            ns.dedup();
            ctx.insert("wgmma", &ns.iter().map(|&n| wgmma_operands(n)).collect::<Vec<_>>());
            ctx.insert("wgmma_path", &(target.mma_path() == moeforge_plan::MmaPath::Wgmma));
            let partial = target.apk_partial();
            (partial.0, vec![("apk.cu.tera", APK), ("ptx.cu.tera", PTX), partial])
        }
    };
    let err = |e: tera::Error| {
        let mut message = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            message.push_str(&format!(": {s}"));
            src = s.source();
        }
        TemplateError { template: name.to_string(), message }
    };
    let mut tera = tera::Tera::default();
    tera.autoescape_on(vec![]);
    tera.add_raw_templates(templates).map_err(err)?;
    tera.render(name, &ctx).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::float_literal;

    #[test]
    fn float_literals_round_trip() {
        assert_eq!(float_literal(2.5), "2.5f");
        assert_eq!(float_literal(1.0), "1.0f");
        assert_eq!(float_literal(2.827), "2.827f");
    }
}
